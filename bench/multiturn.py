"""Multi-turn chat over HTTP: mlx-pte with and without prompt reuse against mlx-lm's server.

    nice -n 0 .venv/bin/python bench/multiturn.py --pte SMOLLM2.pte --hf-dir ~/.cache/mlx-pte/smollm2-135m

Each server runs in its own process, one after the other, on the same checkpoint (the
.pte is an export of the HF directory mlx-lm loads). ``--conversations`` clients talk at
once; each sends ``--turns`` OpenAI chat requests (streamed, greedy, ``--max-tokens``, the
same body for every server), each resending the whole history: a shared
system prompt, the user's messages and the server's own replies. Measured: time to first
token (first content chunk) p50/p95 over all requests and over turns 2+, aggregate
completion tokens per second of the whole workload, prompt tokens the server reports
as cached. mlx-pte's two runs must reply identically (greedy): the script says if not.

``--rounds N`` runs every server once per round, in turn, so a drift in the machine's
speed hits the servers of a round alike; the summary gives each figure's median over the
rounds and each ratio as the median of the per-round ratios.

Targets: TTFT p50 with reuse <= 0.5x without (issue 11); TTFT p50 and p95 <= mlx-lm's and
aggregate tok/s >= 1.2x mlx-lm's (issue 22).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

# mlx-lm's server with the BLAS mlx-pte's processes load (runtime/mlx/blas.py): without it
# MLX's Linux CPU wheel multiplies on its reference BLAS, ~30x slower in fp32.
MLX_LM_SERVER = (
    "import sys, runpy; import mlx_pte.runtime.mlx.blas; sys.argv[0] = 'mlx_lm.server'; "
    "runpy.run_module('mlx_lm.server', run_name='__main__', alter_sys=True)"
)

SYSTEM = (
    "You are a patient assistant for a team that maintains a small Python library. "
    "Answer in plain sentences, without lists or code unless asked. The library reads "
    "configuration files, validates them against a schema, merges defaults, and reports "
    "every error with the file, line and field it concerns. Its users are developers who "
    "embed it in command-line tools and services; they care about clear messages, stable "
    "behaviour across versions, and startup time. The maintainers prefer small modules "
    "with one job each, type hints, dataclasses, and tests that compare against an "
    "independent oracle. When you are unsure, say so and suggest how to find out. "
) * 3
OPENERS = [
    "How should we report a missing required field?",
    "What is a good way to merge defaults into nested sections?",
    "How can we keep startup time low when the schema is large?",
    "Should unknown fields be errors or warnings?",
    "How do we test error messages without making the tests brittle?",
    "What should happen when two files set the same field?",
    "How can a user find which file a value came from?",
    "How should we version the schema itself?",
]
FOLLOW_UPS = ["Can you give a short example?", "What are the risks of that approach?",
              "How would you explain it to a new contributor?", "Summarize your advice in one sentence."]
START_TIMEOUT = 600.0
REQUEST_TIMEOUT = 3600.0  # a slow peer on a busy CPU can take minutes per prefill


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft: float
    seconds: float
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    text: str


@dataclass
class Run:
    name: str
    turns: list[Turn] = field(default_factory=list)
    wall: float = 0.0

    def ttft(self, first_turn: int = 0) -> list[float]:
        return sorted(t.ttft for t in self.turns if t.turn >= first_turn)

    @property
    def tps(self) -> float:
        return sum(t.completion_tokens for t in self.turns) / self.wall


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def chat_turn(client: httpx.Client, url: str, model: str, messages: list, max_tokens: int) -> tuple:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    pieces: list[str] = []
    usage: dict = {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: "):])
            if "error" in payload:
                raise RuntimeError(f"{model}: {payload['error']}")
            for choice in payload.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    pieces.append(content)
            usage = payload.get("usage") or usage
    done = time.perf_counter()
    return (first or done) - start, done - start, "".join(pieces), usage


def conversation(url: str, model: str, index: int, turns: int, max_tokens: int) -> list[Turn]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": OPENERS[index % len(OPENERS)]}]
    out = []
    with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
        for turn in range(turns):
            ttft, seconds, text, usage = chat_turn(client, url, model, messages, max_tokens)
            details = usage.get("prompt_tokens_details") or {}
            out.append(Turn(index, turn, ttft, seconds, int(usage.get("completion_tokens", 0)),
                            int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0), text))
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    return out


def wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not ready after {START_TIMEOUT:.0f} s")


def warm_up(url: str, model: str, clients: int) -> None:
    """Requests unrelated to the workload, so that what a server compiles or allocates per
    shape happens before the timing: one long prompt (a full prefill chunk), then as many
    concurrent short ones as the workload has clients (every decode batch size)."""
    text = " ".join(f"Item {i} of the inventory is a crate of {i * 7 % 13} lamps." for i in range(20))

    def one(content: str) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
            chat_turn(client, url, model, [{"role": "user", "content": content}], 8)

    one(text)
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, [f"Count to {i}." for i in range(clients)]))


def run_server(name: str, command: list[str], port: int, model: str, args) -> Run:
    url = f"http://127.0.0.1:{port}"
    log = open(Path(args.log_dir) / f"{name}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_ready(url, process)
        warm_up(url, model, args.conversations)
        run = Run(name)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.conversations) as pool:
            jobs = [pool.submit(conversation, url, model, i, args.turns, args.max_tokens)
                    for i in range(args.conversations)]
            for job in jobs:
                run.turns += job.result()
        run.wall = time.perf_counter() - start
        return run
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pte", required=True, help="the exported .pte (fp32) of --hf-dir")
    parser.add_argument("--hf-dir", required=True, help="the HF checkpoint directory mlx-lm serves")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--only", default="mlx-pte-reuse,mlx-pte-cold,mlx-lm", help="servers to run, comma-separated")
    parser.add_argument("--log-dir", default=".", help="where each server's log goes")
    parser.add_argument("--json", default=None, help="also write every turn's figures here")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, each running every server in turn")
    args = parser.parse_args()

    serve = [sys.executable, "-m", "mlx_pte", "serve", args.pte, "--model-id", "mlx-pte"]
    servers = {
        "mlx-pte-reuse": (serve, "mlx-pte"),
        "mlx-pte-cold": (serve + ["--prompt-cache-tokens", "0"], "mlx-pte"),
        "mlx-lm": ([sys.executable, "-c", MLX_LM_SERVER, "--model", args.hf_dir], args.hf_dir),
    }
    names = [n for n in args.only.split(",") if n]
    rounds: list[dict[str, Run]] = []
    for number in range(args.rounds):
        runs: dict[str, Run] = {}
        rounds.append(runs)
        for i, name in enumerate(names):
            command, model = servers[name]
            port = args.port + i
            runs[name] = run = run_server(name, command + ["--port", str(port)], port, model, args)
            print(f"round {number + 1}/{args.rounds} {name}: done in {run.wall:.1f} s: {row(name, run)}",
                  file=sys.stderr, flush=True)
            if args.json:  # after each server, so a later failure loses nothing
                Path(args.json).write_text(json.dumps(
                    [{n: {"wall": r.wall, "turns": [vars(t) for t in r.turns]} for n, r in rs.items()}
                     for rs in rounds], indent=1))

    print(f"\n{args.conversations} conversations x {args.turns} turns, max_tokens {args.max_tokens}, greedy, "
          f"{args.rounds} round(s); times in ms (a shared machine: noisy)\n")
    print(f"{'server':<15} {'TTFT p50':>9} {'TTFT p95':>9} {'turns 2+ p50':>13} {'p95':>7} {'tok/s':>7} "
          f"{'prompt tok':>11} {'cached':>8}")
    for number, runs in enumerate(rounds):
        for name, run in runs.items():
            print(row(name, run) + (f"  (round {number + 1})" if args.rounds > 1 else ""))
    if args.rounds > 1:
        print("medians over the rounds:")
        for name in names:
            print(median_row(name, [runs[name] for runs in rounds]))

    def ratio(figure, a: str, b: str) -> float:
        return statistics.median(figure(runs[a]) / figure(runs[b]) for runs in rounds)

    def p50(run: Run) -> float:
        return percentile(run.ttft(), 50)

    def p95(run: Run) -> float:
        return percentile(run.ttft(), 95)

    if "mlx-pte-reuse" in names and "mlx-pte-cold" in names:
        print(f"\nTTFT p50 reuse / cold: {ratio(p50, 'mlx-pte-reuse', 'mlx-pte-cold'):.2f} (target <= 0.5)")
        same = all({(t.conversation, t.turn): t.text for t in runs["mlx-pte-reuse"].turns} == {
            (t.conversation, t.turn): t.text for t in runs["mlx-pte-cold"].turns} for runs in rounds)
        print(f"mlx-pte replies with and without reuse identical: {same}")
    if "mlx-pte-reuse" in names and "mlx-lm" in names:
        print(f"TTFT p50 reuse / mlx-lm: {ratio(p50, 'mlx-pte-reuse', 'mlx-lm'):.2f} (target <= 1)")
        print(f"TTFT p95 reuse / mlx-lm: {ratio(p95, 'mlx-pte-reuse', 'mlx-lm'):.2f} (target <= 1)")
        print(f"aggregate tok/s reuse / mlx-lm: {ratio(lambda r: r.tps, 'mlx-pte-reuse', 'mlx-lm'):.2f} "
              "(target >= 1.2)")


def figures(run: Run) -> tuple[float, ...]:
    """TTFT p50, p95, turns-2+ p50, p95 (ms), tok/s, prompt tokens, cached tokens."""
    all_ttft, later = run.ttft(), run.ttft(1) or [float("nan")]  # one turn: no later turns
    return (1e3 * percentile(all_ttft, 50), 1e3 * percentile(all_ttft, 95), 1e3 * percentile(later, 50),
            1e3 * percentile(later, 95), run.tps, sum(t.prompt_tokens for t in run.turns),
            sum(t.cached_tokens for t in run.turns))


def format_row(name: str, values: Sequence[float]) -> str:
    widths, points = (9, 9, 13, 7, 7, 11, 8), (0, 0, 0, 0, 1, 0, 0)
    return f"{name:<15} " + " ".join(f"{v:>{w}.{p}f}" for v, w, p in zip(values, widths, points))


def median_row(name: str, runs: list[Run]) -> str:
    return format_row(name, [statistics.median(column) for column in zip(*(figures(r) for r in runs))])


def row(name: str, run: Run) -> str:
    return format_row(name, figures(run))


if __name__ == "__main__":
    main()
