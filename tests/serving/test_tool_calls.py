"""Tool calls parsed out of model text (both formats, whole and streamed), the call format
read from a template's text, and tools rendered through a template exactly as
transformers' ``apply_chat_template`` renders them."""
from __future__ import annotations

import copy
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mlx_pte.serving.openai.chat_messages import template_messages
from mlx_pte.serving.openai.request import ApiError, tool_use
from mlx_pte.serving.openai.request_fields import FieldError
from mlx_pte.serving.openai.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    ToolCall,
    ToolCallStream,
    ToolsUnsupported,
    parse_reply,
    template_format,
)
from mlx_pte.serving.sampling.grammar import GrammarError, TokenVocabulary, mask_words
from mlx_pte.serving.openai.tool_grammar import tool_call_grammar
from mlx_pte.serving.openai.tool_request import parse_tool_use
from tests.fixtures.tiny_models import CHAT_TEMPLATE as TINY_TEMPLATE
from tests.fixtures.tool_templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE, TOOL_CONVERSATION, TOOLS
from tests.interpreter.test_chat_template import codec_for


def calls_of(reply) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.calls]


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>',
     None, [("get_weather", {"city": "Oslo", "unit": "C"})]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
     '<tool_call>{"name": "b", "arguments": {"x": [1, "é"]}}</tool_call>',
     "Let me check.", [("a", {}), ("b", {"x": [1, "é"]})]),
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}</tool_call>', None, [("a", {"k": 2})]),
    ('<tool_call>{"name": "a", "arguments": {"k": 1}}', None, [("a", {"k": 1})]),  # cut off by the end
    ("no call here", "no call here", []),
    ("<tool_call>{not json}</tool_call> tail", "<tool_call>{not json}</tool_call> tail", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('a <tool_call>{"name": "f", "arguments": {}}</tool_call> b', "a b", [("f", {})]),
])
def test_hermes_replies_parse(text, content, calls):
    reply = parse_reply(HERMES, text)
    assert reply.content == content and calls_of(reply) == calls


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 1}}',
     None, [("a", {}), ("b", {"n": 1})]),
    ('  {"name": "a", "arguments": {"q": null}}\n', None, [("a", {"q": None})]),
    ("It is sunny.", "It is sunny.", []),
    ('{"name": "a", "parameters": {}} and more', '{"name": "a", "parameters": {}} and more', []),
    ('{"nom": "a"}', '{"nom": "a"}', []),
    ("{", "{", []),
])
def test_llama3_replies_parse(text, content, calls):
    reply = parse_reply(LLAMA3_JSON, text)
    assert reply.content == content and calls_of(reply) == calls


def streamed(fmt: str, text: str, cuts: list[int], max_calls=None) -> tuple[str, list[tuple[str, dict]]]:
    stream, pieces, start = ToolCallStream(fmt, max_calls), [], 0
    for cut in sorted(cuts) + [len(text)]:
        pieces += stream.feed(text[start:cut])
        start = cut
    pieces += stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content, [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]


names = st.from_regex(r"[a-z_]{1,12}", fullmatch=True)
arguments = st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=8), st.booleans()),
                            max_size=3)
prose = st.text(st.characters(blacklist_categories=["Cs"]), max_size=20)


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.one_of(prose, st.tuples(names, arguments)), max_size=5), data=st.data())
def test_hermes_calls_written_by_json_dumps_come_back_streamed_at_any_cut(parts, data):
    """The oracle is the text built from known calls: every call comes back, in order, with
    its arguments, however the text is cut into deltas; the prose stays prose."""
    text = "".join(p if isinstance(p, str) else
                   f'<tool_call>\n{json.dumps({"name": p[0], "arguments": p[1]})}\n</tool_call>' for p in parts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    content, calls = streamed(HERMES, text, cuts)
    expected = [p for p in parts if not isinstance(p, str)]
    if any("<tool_call>" in p for p in parts if isinstance(p, str)):
        return  # prose that itself opens a call block is not a fixed point
    assert calls == [(name, args) for name, args in expected]
    if not expected:
        assert content == text  # text without calls comes out exactly as it went in
    whole = parse_reply(HERMES, text)
    assert (whole.content or "", calls_of(whole)) == (content, calls)


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3), tag=st.booleans(), data=st.data())
def test_llama3_calls_come_back_streamed_at_any_cut(calls, tag, data):
    text = ("<|python_tag|>" if tag else "") + "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls)
    content, parsed = streamed(LLAMA3_JSON, text, data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    assert content == "" and parsed == calls


def test_parallel_false_keeps_the_first_call_only():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert calls_of(parse_reply(HERMES, text, max_calls=1)) == [("a", {})]
    assert streamed(HERMES, text, [7, 40], max_calls=1) == ("", [("a", {})])


def test_the_call_format_comes_from_the_template_text():
    assert template_format(HERMES_TEMPLATE) == HERMES
    assert template_format(LLAMA3_TEMPLATE) == LLAMA3_JSON
    with pytest.raises(ToolsUnsupported, match="does not render tools"):
        template_format(TINY_TEMPLATE)
    with pytest.raises(ToolsUnsupported, match="format this server does not parse"):
        template_format("{% for t in tools %}[TOOL_CALLS]{{ t | tojson }}{% endfor %}")


def hf_messages(messages: list[dict]) -> list[dict]:
    """The conversation as one writes it for transformers: call arguments as objects."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        if m.get("content") is None:
            m["content"] = ""
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, LLAMA3_TEMPLATE], ids=["hermes", "llama3"])
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_tools_and_tool_turns_render_as_transformers_renders_them(tiny_tokenizer, template, tools):
    expected = tiny_tokenizer.apply_chat_template(hf_messages(TOOL_CONVERSATION), tools=tools, chat_template=template,
                                                  tokenize=False, add_generation_prompt=True)
    use = parse_tool_use({"tools": tools}, template)
    ours = codec_for(tiny_tokenizer, template).render_chat(template_messages(TOOL_CONVERSATION), tools=use.tools)
    assert ours == expected
    assert ("The weather in a city" in ours) == (tools is not None)  # the tool schemas were rendered


@pytest.mark.parametrize("messages, where", [
    ([{"role": "user", "content": "x", "colour": "red"}], "messages[0].colour"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": "x", "refusal": "no"}], "messages[0].refusal"),
])
def test_bad_messages_are_refused_naming_the_spot(messages, where):
    with pytest.raises(FieldError, match=re.escape(where)) as info:
        template_messages(messages)
    assert info.value.param == "messages"


def test_an_echoed_reply_message_is_accepted():
    """What a client appends after a reply (null refusal and audio) renders as its content."""
    (message,) = template_messages([{"role": "assistant", "content": "hi", "refusal": None, "audio": None}])
    assert message == {"role": "assistant", "content": "hi"}


@pytest.mark.parametrize("body, param, match", [
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", r"tools\[0\] must be"),
    ({"tools": [{**TOOLS[0], "extra": 1}]}, "tools", r"tools\[0\]\.extra"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "of an object"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be one of"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": []}}}, "tool_choice", "as an object"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls", "true or false"),
])
def test_bad_tool_fields_are_refused_naming_them(body, param, match):
    with pytest.raises(FieldError, match=match) as info:
        parse_tool_use(body, HERMES_TEMPLATE)
    assert info.value.param == param


def test_tools_on_a_template_without_them_are_refused():
    with pytest.raises(FieldError, match="does not render tools") as info:
        parse_tool_use({"tools": TOOLS}, TINY_TEMPLATE)
    assert info.value.param == "tools"


def test_a_tokenizer_that_makes_the_call_marker_special_is_refused(tiny_tokenizer):
    """Decoding drops special tokens, so a call opened by a special <tool_call> could never be
    parsed: tools are refused rather than silently never called."""
    special = copy.deepcopy(tiny_tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    for tokenizer, refused in ((tiny_tokenizer, False), (special, True)):
        engine = SimpleNamespace(codec=codec_for(tokenizer, HERMES_TEMPLATE))
        if refused:
            with pytest.raises(ApiError, match="special token") as info:
                tool_use({"tools": TOOLS}, engine)
            assert info.value.param == "tools"
            tool_use({"tools": TOOLS, "tool_choice": "none"}, engine)  # not parsed: fine
        else:
            assert tool_use({"tools": TOOLS}, engine).parses


def strict(tools: list) -> list:
    return [{"type": "function", "function": {**t["function"], "strict": True}} for t in tools]


WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
HERMES_CASES = [  # (text, whether a reply may be exactly this)
    ("It is cold.", True),
    ("a < b and <tool_ca", True),
    (f"Let me look.<tool_call>\n{WEATHER_CALL}\n</tool_call>", True),
    (f"<tool_call>\n{WEATHER_CALL}\n</tool_call>", True),
    (f"<tool_call>\n{WEATHER_CALL}\n</tool_call>\n<tool_call>\n{WEATHER_CALL}\n</tool_call>", True),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>', False),
    ("<tool_call>\nnot json\n</tool_call>", False),
    (f"<tool_call>\n{WEATHER_CALL}\n</tool_call> and then text", False),
]
LLAMA3_CASES = [
    ("It is cold.", True),
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', True),
    ('{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}', True),
    ('{"name": "get_time", "parameters": {"zone": "PST"}}', False),
    ('{"answer": 42}', False),
]


def reply_allowed(grammar, tokenizer, text: str) -> bool:
    """Whether a reply may be exactly ``text``: every token allowed, then eos."""
    vocabulary = TokenVocabulary.of(tokenizer.backend_tokenizer.to_str(), len(tokenizer), [tokenizer.eos_token_id])
    matcher = vocabulary.matcher(grammar)
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        try:
            matcher.consume(token)
        except GrammarError:
            return False
    row = np.zeros(mask_words(len(tokenizer)), dtype=np.int32)
    matcher.fill_mask(row)
    eos = tokenizer.eos_token_id
    return bool(row[eos // 32] >> (eos % 32) & 1)


@pytest.mark.parametrize("template, cases", [(HERMES_TEMPLATE, HERMES_CASES), (LLAMA3_TEMPLATE, LLAMA3_CASES)],
                         ids=["hermes", "llama3"])
def test_strict_functions_under_auto_allow_text_or_valid_calls_only(tiny_tokenizer, template, cases):
    """The grammar is checked token by token with the grammar engine's own matcher against
    replies written by hand: text, or calls that validate; a broken call is refused."""
    grammar = tool_call_grammar(parse_tool_use({"tools": strict(TOOLS)}, template))
    assert [reply_allowed(grammar, tiny_tokenizer, text) for text, _ in cases] == [ok for _, ok in cases]


@pytest.mark.parametrize("template, call", [
    (HERMES_TEMPLATE, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'),
    (LLAMA3_TEMPLATE, '{"name": "get_time", "parameters": {"zone": "UTC"}}')], ids=["hermes", "llama3"])
def test_a_forced_call_allows_that_call_and_nothing_else(tiny_tokenizer, template, call):
    named = {"type": "function", "function": {"name": "get_time"}}
    grammar = tool_call_grammar(parse_tool_use({"tools": TOOLS, "tool_choice": named}, template))
    assert reply_allowed(grammar, tiny_tokenizer, call)
    assert not reply_allowed(grammar, tiny_tokenizer, "It is noon.")
    assert not reply_allowed(grammar, tiny_tokenizer, call.replace("get_time", "get_weather"))
    assert not reply_allowed(grammar, tiny_tokenizer, call + ("\n" + call if template == HERMES_TEMPLATE else "; " + call))
    assert tool_call_grammar(parse_tool_use({"tools": TOOLS}, template)) is None  # auto, not strict: parsed only
