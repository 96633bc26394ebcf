"""Chat templates render in a sandbox: escapes are refused without running anything, and
real templates render exactly what transformers' apply_chat_template renders."""
from __future__ import annotations

import jinja2
import pytest

from mlx_pte.interpreter.chat_template import MAX_TEXT, ChatTemplate, ChatTemplateError
from mlx_pte.interpreter.text import TextCodec
from mlx_pte.ir.manifest import CacheLayerSpec, Manifest
from tests.fixtures.tiny_models import CHAT_TEMPLATE as TINY_TEMPLATE

# Templates in the styles of the families' real ones (written for these tests): header
# blocks and a dated system turn (Llama 3), ChatML with a namespace scan (Qwen), strict
# user/model alternation with the system text folded into the first turn (Gemma).
LLAMA3_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "01 Jan 2025" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_text = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_text = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}{{- tools | tojson(indent=4) }}{%- endif %}
{{- system_text }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles may follow the system message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML_STYLE = """{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('A system message may only come first') }}{%- endif %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == 'assistant' and loop.index0 > ns.last_user %}
        {{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

GEMMA_STYLE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set prefix = messages[0]['content'] | trim + '\\n\\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 is even) -%}
        {{ raise_exception('Turns must alternate user/assistant/user/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' ~ role ~ '\\n' ~ (prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# The bundled default model's template (scripts/train_default_model.py).
DEFAULT_MODEL_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)

TEMPLATES = {"tiny": TINY_TEMPLATE, "default": DEFAULT_MODEL_STYLE, "llama3": LLAMA3_STYLE,
             "chatml": CHATML_STYLE, "gemma": GEMMA_STYLE}  # fmt: skip

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "  How are you?\n"},
    ],
    [{"role": "user", "content": "quotes \" ' {{ not a tag }} {% neither %} <|eot_id|> ünïcödé 🙂"}],
]


def codec_for(hf_tokenizer, template: str) -> TextCodec:
    manifest = Manifest(
        config={}, dtype="float32", vocab_size=len(hf_tokenizer), cache=(CacheLayerSpec(0, 1, 4, 4),),
        max_step=8, max_context=64, tokenizer=hf_tokenizer.backend_tokenizer.to_str(), chat_template=template,
        bos_token_id=hf_tokenizer.bos_token_id, eos_token_ids=(hf_tokenizer.eos_token_id,),
        pad_token_id=hf_tokenizer.pad_token_id,
    )
    return TextCodec(manifest)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_what_transformers_renders(tiny_tokenizer, name, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    try:
        expected = tiny_tokenizer.apply_chat_template(messages, chat_template=TEMPLATES[name], tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:
        with pytest.raises(ChatTemplateError, match=str(exc)):
            codec_for(tiny_tokenizer, TEMPLATES[name]).render_chat(messages, add_generation_prompt)
        return
    assert codec_for(tiny_tokenizer, TEMPLATES[name]).render_chat(messages, add_generation_prompt) == expected


@pytest.mark.parametrize("name", ["chatml", "gemma", "llama3"])
def test_raise_exception_is_one_clear_error_as_in_transformers(tiny_tokenizer, name):
    messages = [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"},
                {"role": "system", "content": "again"}]  # fmt: skip
    with pytest.raises(jinja2.TemplateError) as hf:
        tiny_tokenizer.apply_chat_template(messages, chat_template=TEMPLATES[name], tokenize=False)
    with pytest.raises(ChatTemplateError) as ours:
        codec_for(tiny_tokenizer, TEMPLATES[name]).render_chat(messages)
    assert str(hf.value) in str(ours.value)


def test_hf_helpers_work_as_in_transformers(tiny_tokenizer):
    template = ("{{ messages | tojson(indent=2, sort_keys=true) }}|{{ strftime_now('%Y') | length }}|"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|"
                "{% generation %}{{ 'kept' }}{% endgeneration %}|{{ dict(a=1).a }}|{{ eos_token }}{{ pad_token }}")
    messages = [{"role": "user", "content": "é <b>"}, {"role": "assistant", "content": "second"}]
    expected = tiny_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert codec_for(tiny_tokenizer, template).render_chat(messages, add_generation_prompt=False) == expected


ESCAPES = {
    "cycler globals": "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "joiner globals": "{{ joiner.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "namespace globals": "{{ namespace.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "lipsum globals": "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
    "subclasses": "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
                  "{{ c(['touch', 'MARKER']) }}{% endif %}{% endfor %}",
    "helper function globals": "{{ raise_exception.__globals__['os'].popen('touch MARKER').read() }}",
    "filter function globals": "{{ (messages | attr('__class__')).__init__.__globals__ }}MARKER",
    "function code object": "{{ strftime_now.__code__.co_consts }}MARKER",
    "str.format attribute walk": "{{ '{0.__class__.__init__.__globals__}'.format(cycler) }}MARKER",
    "format_map attribute walk": "{{ '{x.__init__.__globals__}'.format_map({'x': cycler}) }}MARKER",
    "dict type walk": "{{ dict.__class__.__subclasses__() }}MARKER",
    "namespace private name": "{% set ns = namespace(__class__=1) %}MARKER",
    "list mutation": "{% set x = [] %}{{ x.append('MARKER') }}",
    "dict mutation": "{% set d = {} %}{{ d.update(a='MARKER') }}",
    "huge string *": "{{ 'MARKER' * 10**10 }}",
    "huge list *": "{{ ['MARKER'] * 10**10 }}",
    "huge power": "{{ 7 ** (10 ** 9) }}MARKER",
    "doubling with ~": "{% set ns = namespace(s='MARKER') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='MARKER') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}",
    "huge range": "{% for i in range(10**10) %}{% endfor %}MARKER",
    "printf width": "{{ '%0999999999d' % 1 }}MARKER",
    "printf * width": "{{ '%*d' % (999999999, 1) }}MARKER",
    "str.format width": "{{ '{:>999999999}'.format('MARKER') }}",
    "ljust": "{{ 'MARKER'.ljust(10**9) }}",
    "center filter": "{{ 'MARKER' | center(10**9) }}",
    "indent filter": "{{ 'MARKER\\n' * 1000 | indent(10**5, true) }}",
    "format filter width": "{{ '%999999999s' | format('MARKER') }}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}MARKER",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escapes_are_refused_and_run_nothing(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    template = ChatTemplate(ESCAPES[name].replace("MARKER", str(marker)))
    with pytest.raises(ChatTemplateError, match="chat template"):
        template.render([{"role": "user", "content": "hi"}])
    assert not marker.exists()


def test_values_up_to_the_limit_render():
    # The bounds refuse only what no prompt needs: a long, legitimately built text still renders.
    text = ChatTemplate("{{ 'ab' * n }}{{ ('x' ~ 'y') * 3 }}{{ '%5d' % 42 }}{{ '{:>4}'.format(7) }}").render(
        [], n=MAX_TEXT // 4)
    assert text == "ab" * (MAX_TEXT // 4) + "xyxyxy" + "   42" + "   7"


@pytest.mark.parametrize("source", ["{% for m in messages %}{{ m }}", "{{ messages | nosuchfilter }}", "{% if %}"])
def test_a_template_that_does_not_compile_is_one_error(source):
    with pytest.raises(ChatTemplateError, match="does not compile.*line 1"):
        ChatTemplate(source)
