"""Tool calling with the official ``openai`` client against live servers whose models carry a
Hermes-style and a Llama-3-style chat template.

A tiny random model does not decide to call a tool, so three things are tested apart:
the conversation with tools and tool turns reaches the model exactly as transformers
renders it (greedy text equal to single-sequence generation on that rendering); replies
shaped from known call text are what the client's own types and stream accumulator read
as tool calls; and (with a grammar) forced calls come back parsed and valid.
"""
from __future__ import annotations

import contextlib
import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from mlx_pte.interpreter.program import Program, load
from mlx_pte.serving.openai.app import create_app
from mlx_pte.serving.engine import Completion, Engine, RequestStats, SampleResult
from mlx_pte.serving.generation import generate
from mlx_pte.serving.openai.response import Reply
from mlx_pte.serving.sampling.params import SamplingParams
from mlx_pte.serving.openai.tool_request import parse_tool_use
from tests.fixtures.json_schemas import short_schemas
from tests.fixtures.long_context import long_context_pte
from tests.fixtures.tool_templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE, TOOL_CONVERSATION, TOOLS
from tests.serving.live_server import serving
from tests.serving.test_server_fuzz import json_values
from tests.serving.test_tool_calls import hf_messages

MODEL = "tiny-tools"
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3": LLAMA3_TEMPLATE}
CALL_TEXT = {  # a reply in each format calling both tools
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "F"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "unit": "F"}}; '
              '{"name": "get_time", "parameters": {"zone": "CET"}}',
}
EXPECTED_CALLS = [("get_weather", {"city": "Lima", "unit": "F"}), ("get_time", {"zone": "CET"})]


@pytest.fixture(scope="module")
def long_program(tmp_path_factory, tiny_tokenizer):
    return load(long_context_pte(tmp_path_factory, tiny_tokenizer))


@pytest.fixture(scope="module")
def reference(long_program):
    """Greedy single-sequence ``generate()`` on the same weights: what each request must give."""
    single = long_program.session("single")

    def run(prompt: str, max_tokens: int):
        single.cache.clear()
        return generate(single, prompt, max_tokens, SamplingParams(), stop_on_eos=False)

    return run


@pytest.fixture(scope="module")
def clients(long_program):
    """``style -> openai.OpenAI`` for a live server per template style, plus ``"plain"``: the
    tiny model's own template, which renders no tools."""
    programs = {style: Program(long_program.graph, long_program.weights,
                               {**long_program.manifest, "chat_template": template})
                for style, template in TEMPLATES.items()}
    programs["plain"] = long_program
    with contextlib.ExitStack() as stack:
        out = {}
        for style, prog in programs.items():
            engine = Engine(prog, "batched-cell", capacity=4096, max_batch_tokens=32)
            url = stack.enter_context(serving(create_app(engine, MODEL)))
            out[style] = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield out


def hf_prompt(tiny_tokenizer, style: str, messages: list, tools) -> str:
    return tiny_tokenizer.apply_chat_template(hf_messages(messages), tools=tools, chat_template=TEMPLATES[style],
                                              tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("style", ["hermes", "llama3"])
def test_a_tool_conversation_reaches_the_model_as_transformers_renders_it(clients, tiny_tokenizer, reference, style):
    expected = reference(hf_prompt(tiny_tokenizer, style, TOOL_CONVERSATION, TOOLS), 8)
    client = clients[style]
    reply = client.chat.completions.create(model=MODEL, messages=TOOL_CONVERSATION, tools=TOOLS, temperature=0,
                                           max_tokens=8, extra_body={"ignore_eos": True})
    (choice,) = reply.choices
    assert choice.message.content == expected.text and choice.message.tool_calls is None
    assert choice.finish_reason == "length" and reply.usage.prompt_tokens == expected.prompt_tokens

    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model=MODEL, messages=TOOL_CONVERSATION, tools=TOOLS, temperature=0,
                                                max_tokens=8, stream=True, extra_body={"ignore_eos": True}):
        state.handle_chunk(chunk)
    (streamed,) = state.current_completion_snapshot.choices  # the final completion refuses "length"
    assert streamed.message.content == expected.text and not streamed.message.tool_calls
    assert streamed.finish_reason == "length"


def test_tool_choice_none_renders_the_tools_and_leaves_the_reply_as_text(clients, tiny_tokenizer, reference):
    expected = reference(hf_prompt(tiny_tokenizer, "hermes", TOOL_CONVERSATION, TOOLS), 5)
    reply = clients["hermes"].chat.completions.create(model=MODEL, messages=TOOL_CONVERSATION, tools=TOOLS,
                                                      tool_choice="none", temperature=0, max_tokens=5,
                                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == expected.text


def test_tools_on_a_model_whose_template_has_none_are_a_400(clients):
    with pytest.raises(openai.BadRequestError) as info:
        clients["plain"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 tools=TOOLS, max_tokens=2)
    assert "does not render tools" in info.value.message and info.value.body["param"] == "tools"


def shaped(style: str, text: str, finish_reason: str = "stop"):
    """``Reply.full`` and the streamed chunks of a sample whose text is ``text`` (cut in
    3-character deltas, as a detokenizer releases it)."""
    tools = parse_tool_use({"tools": TOOLS}, TEMPLATES[style])
    sample = SampleResult(0, [1] * 5, text, finish_reason)
    reply = Reply.new(MODEL, chat=True)
    full = reply.full(Completion(0, 10, [sample], RequestStats(10, 0.0)), tools)
    chunks, stream = [reply.chunk(0, None, role=True)], reply.sample_chunks(0, tools)
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    for i, piece in enumerate(pieces):
        chunks += stream.on(piece, finish_reason if i == len(pieces) - 1 else None)
    return full, chunks


@pytest.mark.parametrize("style", ["hermes", "llama3"])
def test_replies_with_calls_are_what_the_openai_client_reads_as_tool_calls(style):
    """The oracle is the client library: its response types and its own stream accumulator."""
    full, chunks = shaped(style, CALL_TEXT[style])
    (choice,) = ChatCompletion.model_validate(full).choices
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == EXPECTED_CALLS
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert choice.message.content == ("Checking." if style == "hermes" else None)

    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    (streamed,) = state.get_final_completion().choices
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls] == EXPECTED_CALLS
    assert (streamed.message.content or None) == choice.message.content


def test_a_reply_cut_by_the_length_limit_keeps_finish_reason_length():
    full, chunks = shaped("hermes", CALL_TEXT["hermes"], "length")
    assert full["choices"][0]["finish_reason"] == "length" and full["choices"][0]["message"]["tool_calls"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def check_calls(calls, names) -> None:
    """Each call names one of ``names`` and its arguments validate against that tool's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("style", ["hermes", "llama3"])
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_a_forced_call_comes_back_parsed_and_valid(clients, style, choice):
    """The grammar makes even a random model call: one call (parallel_tool_calls false, or a
    named function), of an allowed function, whose arguments validate, whole and streamed."""
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    names = {"get_weather", "get_time"} if choice == "required" else {choice}
    kw = dict(model=MODEL, messages=TOOL_CONVERSATION[:2], tools=TOOLS, tool_choice=tool_choice,
              parallel_tool_calls=False, max_tokens=120)
    for seed in range(2):
        (choice_,) = clients[style].chat.completions.create(**kw, seed=seed, temperature=1.0).choices
        assert choice_.finish_reason == "tool_calls"
        assert len(choice_.message.tool_calls) == 1
        check_calls(choice_.message.tool_calls, names)
        assert choice_.message.content is None

        state = ChatCompletionStreamState(input_tools=TOOLS)
        for chunk in clients[style].chat.completions.create(**kw, seed=seed, temperature=1.0, stream=True):
            state.handle_chunk(chunk)
        (streamed,) = state.get_final_completion().choices
        assert streamed.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in choice_.message.tool_calls]  # the same seed


@pytest.mark.parametrize("style", ["hermes", "llama3"])
def test_required_with_parallel_calls_gives_valid_calls_for_every_sample(clients, style):
    replies = clients[style].chat.completions.create(
        model=MODEL, messages=TOOL_CONVERSATION[:2], tools=TOOLS, tool_choice="required", n=3, seed=1,
        temperature=1.0, max_tokens=200)
    for choice in replies.choices:
        if choice.finish_reason == "tool_calls":  # the grammar let the model stop after any call
            check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
        else:  # it went on calling until max_tokens; every call it completed is valid
            assert choice.finish_reason == "length"
            if choice.message.tool_calls:
                check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    assert any(c.finish_reason == "tool_calls" for c in replies.choices)


def test_a_forced_call_and_a_response_format_together_are_a_400(clients):
    error = pytest.raises(openai.BadRequestError, clients["hermes"].chat.completions.create, model=MODEL,
                          messages=TOOL_CONVERSATION[:2], tools=TOOLS, tool_choice="required",
                          response_format={"type": "json_object"}, max_tokens=5).value
    assert error.body["param"] == "response_format"


tool_names = st.from_regex(r"[a-z][a-z_]{0,7}", fullmatch=True)
object_schemas = short_schemas.filter(lambda s: s.get("type") == "object")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(style=st.sampled_from(["hermes", "llama3"]), data=st.data(),
       schemas=st.lists(st.tuples(tool_names, object_schemas), min_size=1, max_size=2, unique_by=lambda t: t[0]),
       parallel=st.booleans(), seed=st.integers(0, 2**31))
def test_forced_calls_validate_for_generated_schemas(clients, style, data, schemas, parallel, seed):
    """Any short object schema as a function's parameters: a forced reply that ends is calls
    whose arguments validate against their function's schema (jsonschema is the oracle)."""
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in schemas]
    choice = data.draw(st.one_of(st.just("required"), st.sampled_from(
        [{"type": "function", "function": {"name": n}} for n, _ in schemas])))
    reply = clients[style].chat.completions.create(
        model=MODEL, messages=TOOL_CONVERSATION[:2], tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
        max_tokens=150, temperature=1.0, seed=seed)
    (answer,) = reply.choices
    assert answer.finish_reason in ("tool_calls", "length")
    calls = answer.message.tool_calls or []
    if answer.finish_reason == "tool_calls":
        assert calls and (parallel and choice == "required" or len(calls) == 1)
    allowed = dict(schemas)
    if choice != "required":
        allowed = {choice["function"]["name"]: allowed[choice["function"]["name"]]}
    for call in calls:
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


schema_keys = st.sampled_from(["type", "properties", "required", "items", "enum", "const", "minimum", "maxLength",
                               "additionalProperties", "$ref", "anyOf", "pattern", "format"])
schema_like = st.recursive(
    st.one_of(json_values, st.sampled_from(["object", "string", "integer", "array", "#/x", "^a+$", "date-time"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.one_of(schema_keys, st.text(max_size=4)),
                                                                         inner, max_size=4)),
    max_leaves=10)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(style=st.sampled_from(["hermes", "llama3"]), parameters=schema_like,
       choice=st.sampled_from(["required", "auto", {"type": "function", "function": {"name": "f"}}]))
def test_any_parameters_value_gets_a_reply_or_a_400(clients, style, parameters, choice):
    """Whatever a client sends as a function's schema, the answer is a reply or a 400 (naming
    'tools', or a rule of the whole body), never a 500."""
    body = {"model": MODEL, "messages": TOOL_CONVERSATION[:2], "max_tokens": 4, "tool_choice": choice,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
    r = httpx.post(f"{clients[style].base_url}chat/completions", content=json.dumps(body).encode(),  # \u escapes
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] in ("tools", None), r.text  # None: a body-wide rule (huge integers)


@pytest.mark.parametrize("style", ["hermes", "llama3"])
def test_strict_functions_under_auto_give_text_or_valid_calls(clients, style):
    """With a strict function the model may still answer in text; any call it makes validates
    and a reply that ends holds no broken call."""
    tools = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    replies = clients[style].chat.completions.create(model=MODEL, messages=TOOL_CONVERSATION[:2], tools=tools, n=4,
                                                     seed=3, temperature=1.0, max_tokens=60)
    for choice in replies.choices:
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        for call in choice.message.tool_calls or []:
            check_calls([call], {"get_weather", "get_time"})
        if choice.finish_reason == "stop":
            assert not choice.message.tool_calls and "<tool_call>" not in (choice.message.content or "")
