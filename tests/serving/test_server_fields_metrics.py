"""The official ``openai`` client against a live server: fields the server does not implement
are 400s naming them, ``/metrics`` parses as Prometheus text and counts what happened,
and ``/tokenize`` / ``/detokenize`` agree with the tokenizer itself (transformers')."""
from __future__ import annotations

import dataclasses
import string
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from mlx_pte.serving.openai.app import create_app
from mlx_pte.serving.engine import Engine, EngineLoad, EngineStats
from mlx_pte.serving.openai.metrics import ServerMetrics
from mlx_pte.serving.openai.request_fields import CHAT_FIELDS, COMPLETION_FIELDS, NO_OP_VALUES
from tests.fixtures.tiny_models import CHAT_TEMPLATE
from tests.serving.live_server import serving

MODEL = "tiny"
TIMEOUT = 60.0
MESSAGES = [{"role": "user", "content": "hello"}]
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def live(program):
    """``(base url, openai client, engine)``; the engine checks its cache is empty at the end."""
    engine = Engine(program, "batched-cell", capacity=600, max_batch_tokens=24)
    with serving(create_app(engine, MODEL)) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT), engine
    assert engine.cache.live_seqs() == ()


@pytest.fixture
def client(live):
    return live[1]


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return info.value


known = CHAT_FIELDS | COMPLETION_FIELDS | set(NO_OP_VALUES)
# Field names a client might invent: identifiers, and odd keys.
field_names = st.one_of(st.from_regex(r"[a-z][a-z_]{0,20}", fullmatch=True),
                        st.text(string.printable, min_size=1, max_size=12)).filter(lambda n: n not in known)
any_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=5), st.just({}), st.just([1]))


@FUZZ
@given(name=field_names, value=any_values)
def test_an_unknown_field_on_chat_is_a_400_naming_it(client, name, value):
    error = refused(lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                                           extra_body={name: value}))
    assert error.body["param"] == name and f"'{name}'" in error.message


@FUZZ
@given(name=field_names, value=any_values)
def test_an_unknown_field_on_completions_is_a_400_naming_it(client, name, value):
    error = refused(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={name: value}))
    assert error.body["param"] == name and f"'{name}'" in error.message


@pytest.mark.parametrize("name, value", [
    ("messages", MESSAGES), ("tools", None), ("max_completion_tokens", 1), ("metadata", {"a": "b"})])
def test_chat_fields_are_refused_on_completions(client, name, value):
    error = refused(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                                      extra_body={name: value}))
    assert error.body["param"] == name


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u-1", "metadata": {"k": "v"},
     "store": False, "service_tier": "auto", "logprobs": False, "response_format": {"type": "text"}},
])
def test_openai_fields_at_their_no_op_values_are_accepted(client, fields):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **fields)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("chat, name, value", [
    (True, "presence_penalty", 0.5), (True, "logit_bias", {"5": 1}), (True, "store", True),
    (True, "functions", [{"name": "f"}]), (False, "top_logprobs", 2), (False, "echo", True), (False, "best_of", 2),
    (False, "suffix", "}"), (True, "user", 7), (True, "stream_options", {"include_obfuscation": True}),
])
def test_unimplemented_values_are_a_400_naming_the_field(client, chat, name, value):
    extra = {name: value, **({"stream": True} if name == "stream_options" else {})}
    if chat:
        error = refused(lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                                               extra_body=extra))
    else:
        error = refused(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=extra))
    assert error.body["param"] == name and name in error.message


def metrics(url: str) -> dict:
    """``{(name, labels): value}`` of every sample /metrics exposes, parsed by prometheus_client."""
    r = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_requests_tokens_and_time_to_first_token(live):
    url, client, engine = live
    before = metrics(url)
    generated = engine.stats.generated_tokens
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="def main():", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=2, stream=True,
                                                temperature=0, extra_body={"ignore_eos": True}):
        pass
    after = metrics(url)

    def grew(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("mlx_pte_request_finished_total", (("finish_reason", "length"),)) == 4  # 2 + n=2
    assert grew("mlx_pte_time_to_first_token_seconds_count") == 3
    assert grew("mlx_pte_generated_tokens_total") == engine.stats.generated_tokens - generated == 2 * 4 + 2 * 3
    assert after[("mlx_pte_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == \
        after[("mlx_pte_time_to_first_token_seconds_count", ())]
    idle = {name: after[(name, ())] for name in ("mlx_pte_queue_requests", "mlx_pte_running_sequences",
                                                 "mlx_pte_cache_reserved")}
    assert idle == dict.fromkeys(idle, 0.0)
    # What the cache still holds when idle (nothing, or prompts kept for reuse); idle, so safe to read here.
    assert after[("mlx_pte_cache_positions", ())] == engine.cache.usage().logical_positions
    assert after[("mlx_pte_cache_capacity", ())] == engine.capacity
    assert after[("mlx_pte_throughput_tokens_per_second", ())] > 0


def test_metrics_see_a_request_while_it_runs(live):
    url, _, engine = live
    with httpx.stream("POST", url + "/v1/completions", timeout=TIMEOUT,
                      json={"prompt": "x", "max_tokens": 150, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        now = metrics(url)
        assert now[("mlx_pte_running_sequences", ())] == 1
        assert 0 < now[("mlx_pte_cache_reserved", ())] <= engine.capacity
        assert now[("mlx_pte_cache_positions", ())] >= 1
    deadline = time.monotonic() + TIMEOUT
    while engine.sequences() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metrics(url)[("mlx_pte_request_finished_total", (("finish_reason", "cancelled"),))] >= 1


def post(url: str, path: str, body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=TIMEOUT)


TEXTS = ["def main():\n    return 0", "ünïcödé 🙂 and <s> tags", "", "   spaces   "]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_tokenize_and_detokenize_agree_with_the_tokenizer(live, tiny_tokenizer, text, special):
    url, _, engine = live
    r = post(url, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": special})
    assert r.status_code == 200, r.text
    expected = tiny_tokenizer(text, add_special_tokens=special)["input_ids"]
    assert r.json() == {"tokens": expected, "count": len(expected), "max_model_len": engine.max_context}
    back = post(url, "/detokenize", {"tokens": expected})
    assert back.json() == {"prompt": tiny_tokenizer.decode(expected, skip_special_tokens=True)}


def test_tokenize_messages_gives_the_chat_prompt(live, tiny_tokenizer):
    url, client, _ = live
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = post(url, "/tokenize", {"messages": messages})
    text = tiny_tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                              add_generation_prompt=True)
    assert r.json()["tokens"] == tiny_tokenizer(text)["input_ids"]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == r.json()["count"]  # what the chat endpoint feeds the model
    without = post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    text = tiny_tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False)
    assert without["tokens"] == tiny_tokenizer(text)["input_ids"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "tools": []}, "tools"),
    ("/tokenize", {"prompt": "a", "with_pieces": True}, "with_pieces"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/tokenize", [1, 2], None),
    ("/detokenize", {"tokens": [1, 99_999]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
])
def test_bad_tokenize_bodies_are_400s(live, path, body, param):
    r = post(live[0], path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_tokenize_refuses_another_model(live):
    r = post(live[0], "/tokenize", {"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_prefix_cache_counters_are_exported_when_the_engine_counts_them():
    """Prompt reuse (another part of the engine) reports prefix_hits and cached_tokens in its
    stats; /metrics exports them once they exist."""
    def families(stats) -> dict:
        engine = SimpleNamespace(load=EngineLoad(), stats=stats, kind="batched-cell", capacity=8)
        text = ServerMetrics(engine).exposition()[0].decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    base = {f.name: 0 for f in dataclasses.fields(EngineStats) if f.name not in ("prefix_hits", "cached_tokens")}
    without = families(SimpleNamespace(**base, decode_tps=0.0, throughput_tps=0.0))
    assert not any(name.startswith("mlx_pte_prefix_cache") for name in without)
    counted = families(SimpleNamespace(**base, decode_tps=0.0, throughput_tps=0.0, prefix_hits=3, cached_tokens=41))
    assert counted["mlx_pte_prefix_cache_hits_total"] == 3
    assert counted["mlx_pte_prefix_cache_hit_tokens_total"] == 41
