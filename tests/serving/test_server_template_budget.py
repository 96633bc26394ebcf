"""A model file whose chat template runs away (nested loops, recursion) stalls nothing: its
chat requests get a 400 naming the template budget, and a plain request sent meanwhile is
answered first, with the text ``generate()`` gives it alone."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mlx_pte.interpreter.program import Program
from mlx_pte.serving.engine import Engine
from mlx_pte.serving.openai.app import create_app
from tests.fixtures.tiny_models import CHAT_TEMPLATE
from tests.serving.live_server import serving

TIMEOUT = 60.0
BUDGET = 1.5
# The tiny template, unless the first message asks for a runaway.
TEMPLATE = (
    "{% if messages[0]['content'] == 'loops' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif messages[0]['content'] == 'recursion' %}"
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
    "{% endif %}" + CHAT_TEMPLATE
)
PLAIN = {"prompt": "The quick brown", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(program):
    runaway = Program(program.graph, program.weights, {**program.manifest, "chat_template": TEMPLATE})
    engine = Engine(runaway, "batched-cell", capacity=400, max_batch_tokens=24)
    with serving(create_app(engine, "tiny", template_budget=BUDGET)) as base:
        yield base


def _timed_post(url: str, body: dict) -> tuple[httpx.Response, float]:
    response = httpx.post(url, json=body, timeout=TIMEOUT)
    return response, time.monotonic()


@pytest.mark.parametrize("content", ["loops", "recursion"])
def test_a_runaway_template_is_refused_while_a_plain_request_is_answered(url, oracle, content):
    chat_body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        chat = pool.submit(_timed_post, url + "/v1/chat/completions", chat_body)
        time.sleep(0.2)  # the render is under way
        plain, plain_done = _timed_post(url + "/v1/completions", PLAIN)
        refused, refused_at = chat.result(timeout=2 * TIMEOUT)
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == oracle(PLAIN["prompt"], 3).text
    assert refused.status_code == 400, refused.text[:300]
    assert f"ran past its budget of {BUDGET:g} s" in refused.json()["error"]["message"]
    assert plain_done < refused_at, "the plain request waited for the template"
    # The same server chats normally afterwards.
    fine = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2}, timeout=TIMEOUT)
    assert fine.status_code == 200
