"""Chat templates render within a CPU-time budget: nested loops and runaway recursion are
refused at the budget with an error naming it, real work under it renders exactly what
plain Jinja renders, and one render's budget is its own (other threads render meanwhile)."""
from __future__ import annotations

import threading
import time

import jinja2
import pytest

from mlx_pte.interpreter.chat_template import MAX_CALL_DEPTH, ChatTemplate, ChatTemplateError
from mlx_pte.interpreter.text import TextCodec
from mlx_pte.ir.manifest import CacheLayerSpec, Manifest
from tests.fixtures.tiny_models import CHAT_TEMPLATE

BUDGET = 0.2
# Far past BUDGET: what a render may overshoot by is one clock interval (microseconds) and
# the single operation in flight; a generous bound that still tells "stopped" from "ran".
SLACK = 1.0

RUNAWAY = {
    # The template: 10^10 iterations that call and print nothing.
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops with a filter": "{% for i in range(100000) %}{% for j in range(100000) if j < 0 %}"
                                  "{% endfor %}{% endfor %}",
    "loops that print": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    # Exponential recursion: 2^40 calls, never deeper than 40.
    "recursion that branches": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                               "{% endmacro %}{{ f(40) }}",
    "recursive loop": "{% for x in range(100000) recursive %}{% if loop.depth < 4 %}{{ loop(range(100000)) }}"
                      "{% endif %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_a_runaway_template_is_refused_at_the_budget(name):
    template = ChatTemplate(RUNAWAY[name])
    start = time.thread_time()
    with pytest.raises(ChatTemplateError, match=rf"ran past its budget of {BUDGET:g} s of CPU time"):
        template.render([{"role": "user", "content": "hi"}], budget=BUDGET)
    assert time.thread_time() - start < BUDGET + SLACK
    # The budget was this render's: the next one renders.
    assert ChatTemplate("{{ messages[0].content }}").render([{"role": "user", "content": "ok"}]) == "ok"


def test_deep_recursion_is_refused_at_the_call_depth():
    template = ChatTemplate("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    with pytest.raises(ChatTemplateError, match=f"nested calls {MAX_CALL_DEPTH} deep"):
        template.render([], budget=BUDGET)


def _jinja(source: str, **variables) -> str:
    """The oracle: plain (unsandboxed, unbudgeted) Jinja with the same block settings."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    return env.from_string(source).render(**variables)


WORK = {
    # 40,000 iterations with a filter and a break: real work, a few tens of ms.
    "loops": "{% for i in range(200) %}{% for j in range(200) if j % 7 == 0 %}{% if j > 190 %}{% break %}"
             "{% endif %}{{ i * j }},{% endfor %}{% endfor %}",
    # Recursion as deep as real templates go (nested JSON schemas), short of the depth limit.
    "recursion": "{% macro f(n) %}[{% if n > 0 %}{{ f(n - 1) }}{% endif %}]{% endmacro %}{{ f(DEPTH) }}"
                 .replace("DEPTH", str(MAX_CALL_DEPTH // 2)),
    "recursive loop": "{% for x in tree recursive %}({{ x.name }}{{ loop(x.children) }}){% endfor %}",
}
TREE = [{"name": "a", "children": [{"name": "b", "children": [{"name": "c", "children": []}]}]},
        {"name": "d", "children": []}]


@pytest.mark.parametrize("name", sorted(WORK))
def test_work_under_the_budget_renders_what_jinja_renders(name):
    assert ChatTemplate(WORK[name]).render([], tree=TREE) == _jinja(WORK[name], tree=TREE, messages=[])


def test_the_budget_is_what_decides():
    source = "{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}done"
    assert ChatTemplate(source).render([]) == "done"  # the default budget
    with pytest.raises(ChatTemplateError, match="budget of 1e-06 s"):
        ChatTemplate(source).render([], budget=1e-6)


def test_a_codec_renders_within_its_template_budget():
    manifest = Manifest(config={}, dtype="float32", vocab_size=8, cache=(CacheLayerSpec(0, 1, 4, 4),), max_step=4,
                        max_context=16, tokenizer=_TINY_TOKENIZER, chat_template=RUNAWAY["nested loops"] + CHAT_TEMPLATE)
    codec = TextCodec(manifest, template_budget=BUDGET)
    with pytest.raises(ChatTemplateError, match=f"budget of {BUDGET:g} s"):
        codec.render_chat([{"role": "user", "content": "hi"}])


def test_other_threads_render_while_one_runs_away():
    runaway = ChatTemplate(RUNAWAY["nested loops"])
    errors: list[Exception] = []

    def run_away():
        try:
            runaway.render([], budget=0.5)
        except ChatTemplateError as exc:
            errors.append(exc)

    worker = threading.Thread(target=run_away)
    worker.start()
    plain = ChatTemplate(CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    rendered = 0
    while worker.is_alive():
        assert plain.render(messages, bos_token="<s>", eos_token="</s>") == _jinja(
            CHAT_TEMPLATE, messages=messages, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
        rendered += 1
    worker.join()
    assert len(errors) == 1 and "budget of 0.5 s" in str(errors[0])
    assert rendered > 0


# The smallest tokenizer the codec builds (the budget test needs a codec, not a vocabulary).
_TINY_TOKENIZER = (
    '{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null, '
    '"pre_tokenizer": null, "post_processor": null, "decoder": null, '
    '"model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}'
)
