"""``serve --tp 2`` (two local ring ranks) through the official ``openai`` client: the same
greedy text as one process serving the whole program, plain, streaming and batched; and a
follower killed while serving stops every rank with an error naming it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from mlx_pte.serving.engine import Engine
from mlx_pte.serving.openai.app import create_app
from mlx_pte.serving.parallel.ranks import STOP_BOUND_S
from tests.fixtures.exported import exported_pte
from tests.serving.live_server import free_port, serving

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
PROMPTS = ["def f(x):", "The class", "import os\n", "Return the"]
START_S = 90.0


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _replies(client: openai.OpenAI) -> dict:
    def one(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # together, so the engine batches them
        batched = list(pool.map(one, PROMPTS))
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                            max_tokens=12, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    return {"batched": batched, "streamed": streamed}


def _ranks_of(parent: int) -> dict[int, int]:
    """MLX_RANK -> pid of ``parent``'s children."""
    ranks = {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
        except (OSError, IndexError, ValueError):
            continue
        if "MLX_RANK" in env:
            ranks[int(env["MLX_RANK"])] = pid
    return ranks


@pytest.fixture(scope="module")
def whole_replies(program) -> dict:
    engine = Engine(program, "batched-cell", capacity=2400, max_batch_tokens=32)
    with serving(create_app(engine, MODEL)) as url:
        return _replies(_client(url))


def test_serve_tp_2_answers_like_one_process_and_stops_when_a_follower_dies(
    tmp_path_factory, tiny_checkpoint, whole_replies
):
    path = exported_pte(tmp_path_factory, tiny_checkpoint, "llama")
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_pte", "serve", str(path), "--port", str(port), "--model-id", MODEL,
           "--cache", "batched-cell", "--capacity", "2400", "--max-batch-tokens", "32", "--tp", "2"]
    server = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        client = _client(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + START_S
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, "serve --tp 2 did not start"
                time.sleep(0.2)
        assert _replies(client) == whole_replies

        ranks = _ranks_of(server.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGKILL)
        _, err = server.communicate(timeout=STOP_BOUND_S + 5)
    finally:
        server.kill()
        for pid in _ranks_of(server.pid).values():
            os.kill(pid, signal.SIGKILL)
    assert server.returncode == 1
    assert "rank 0: rank 1 stopped" in err and "rank 1 of 2 was killed by SIGKILL" in err
