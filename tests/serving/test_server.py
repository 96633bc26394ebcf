"""The OpenAI-compatible server over real HTTP: uvicorn on 127.0.0.1 in a thread, httpx clients.

Completions are checked against single-sequence ``generate()`` (greedy), so concurrent
requests sharing the engine must each get exactly what they would get alone.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mlx_pte.serving.engine import Engine
from mlx_pte.serving.openai.app import create_app
from mlx_pte.interpreter.text import TextCodec
from mlx_pte.ir.manifest import Manifest
from tests.serving.live_server import serving


MODEL = "tiny-llama"
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def served(program):  # noqa: F811
    """``(base url, engine)`` of a server running until the module's tests end."""
    engine = Engine(program, "batched-cell", capacity=600, max_batch_tokens=24)
    with serving(create_app(engine, MODEL)) as url:
        yield url, engine
    assert engine.cache.live_seqs() == ()


@pytest.fixture
def base_url(served):
    return served[0]


def post(base_url, path, body, **kw):
    return httpx.post(base_url + path, json=body, timeout=TIMEOUT, **kw)


def sse_payloads(response: httpx.Response) -> list:
    """The data payloads of a server-sent event stream; the last must be [DONE]."""
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def chat_text(program, messages):  # noqa: F811
    return TextCodec(Manifest.from_dict(program.manifest)).render_chat(messages)


def test_health_and_models(base_url):
    assert httpx.get(base_url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    models = httpx.get(base_url + "/v1/models", timeout=TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_concurrent_streaming_and_plain_requests_match_single_runs(base_url, program, oracle):  # noqa: F811
    prompts = ["def main():", "The quick brown", "import os\nimport sys", "x"]
    messages = [{"role": "user", "content": "hello there"}]

    def plain(prompt):
        r = post(base_url, "/v1/completions",
                 {"model": MODEL, "prompt": prompt, "max_tokens": 7, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == MODEL
        assert body["usage"]["completion_tokens"] == 7
        (choice,) = body["choices"]
        return choice["text"], choice["finish_reason"]

    def streamed(prompt):
        r = post(base_url, "/v1/completions",
                 {"prompt": prompt, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_payloads(r)
        return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]

    def chat(stream):
        r = post(base_url, "/v1/chat/completions",
                 {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0,
                  "ignore_eos": True, "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            (choice,) = r.json()["choices"]
            return choice["message"]["content"], choice["finish_reason"]
        chunks = sse_payloads(r)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        return text, chunks[-1]["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(plain, p) for p in prompts[:2]]
        jobs += [pool.submit(streamed, p) for p in prompts[2:]]
        jobs += [pool.submit(chat, False), pool.submit(chat, True)]
        results = [job.result(timeout=2 * TIMEOUT) for job in jobs]

    expected = [oracle(p, 7).text for p in prompts] + [oracle(chat_text(program, messages), 6).text] * 2
    assert [text for text, _ in results] == expected
    assert all(reason == "length" for _, reason in results)


def test_n_samples_and_usage_in_a_stream(base_url, oracle):  # noqa: F811
    r = post(base_url, "/v1/completions",
             {"prompt": "def main():", "max_tokens": 5, "temperature": 0, "n": 2, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_payloads(r)
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
             for i in range(2)]
    assert texts == [oracle("def main():", 5).text] * 2
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 10 and usage["prompt_tokens"] == oracle("def main():", 5).prompt_tokens


@pytest.mark.parametrize(
    "path, body, status, code, param",
    [
        ("/v1/completions", b"{not json", 400, None, None),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found", "model"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, 400, "context_length_exceeded", "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, None, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, None, None),
        ("/v1/completions", {"max_tokens": 3}, 400, None, "prompt"),
        ("/v1/completions", {"prompt": [1, 99_999]}, 400, None, None),
        ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, None, "logprobs"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, None, "messages"),
        ("/v1/nowhere", {}, 404, None, None),
    ],
)
def test_bad_requests_get_openai_errors(base_url, path, body, status, code, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(base_url + path, timeout=TIMEOUT, **kw)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == code and error["param"] == param


def test_serving_continues_after_errors_and_abandoned_streams(served, oracle):  # noqa: F811
    base_url, engine = served
    generated = engine.stats.generated_tokens
    # A client that walks away mid-stream: its request is cancelled, nothing else notices.
    with httpx.stream("POST", base_url + "/v1/completions", timeout=TIMEOUT,
                      json={"prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + TIMEOUT
    while engine.sequences() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.sequences() == []
    assert engine.stats.generated_tokens - generated < 200, "the abandoned request ran to the end"
    assert post(base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 10_000}).status_code == 400
    r = post(base_url, "/v1/completions",
             {"prompt": "The quick brown", "max_tokens": 7, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == oracle("The quick brown", 7).text
