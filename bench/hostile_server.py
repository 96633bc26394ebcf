"""Hostile-client probes of a running ``mlx-pte serve`` (issue 12's reproductions).

    .venv/bin/python bench/hostile_server.py --url http://127.0.0.1:8000 [--pid SERVER_PID] [--only NAME,...]

Runs each probe against the live server and prints one JSON object per probe, then a
per-category summary (inputs tried, clear errors, crashes, hangs). Figures are wall
times of a shared machine: treat them as orders of magnitude.

Probes:
* ``poisoned``: a request with ``temperature 1e-320`` among three concurrent streaming
  greedy requests; did the three finish with the text they give alone?
* ``long_stops``: four stop strings of 250,000 characters (``max_tokens`` 8), and the
  latency of a concurrent 4-token request against the same request alone.
* ``stops_at_bound``: four stop strings of 1000 characters (the bound) against none, 64 tokens.
* ``abandoned``: four non-streaming requests abandoned after 0.5 s, then the latency of a
  64-token request against the same request alone.
* ``slow_clients``: half the request headers, and headers with half the body: seconds
  until the server answers or closes (capped).
* ``validation``, ``body_size``: bad inputs, each followed by a normal request on the
  same keep-alive connection; ``body_size`` also reports /health latency while a 5 MB
  prompt is processed and the server's peak RSS (``--pid``) after a 200 MB body.
"""
from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx

CAP_S = 120.0  # a probe that waits longer than this counts as a hang
NORMAL = {"prompt": "The for statement", "max_tokens": 4, "temperature": 0}


def _text(response: httpx.Response) -> str:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        out = []
        for block in response.text.split("\n\n"):
            data = block[len("data: "):] if block.startswith("data: ") else ""
            if data and data != "[DONE]":
                payload = json.loads(data)
                if "error" in payload:
                    return f"<error: {payload['error']['message'][:80]}>"
                out.extend(c.get("text", "") for c in payload.get("choices", []))
        return "".join(out)
    return response.json()["choices"][0]["text"]


def completion(url: str, body: dict, client: httpx.Client | None = None) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    c = client or httpx.Client(timeout=CAP_S)
    try:
        r = c.post(url + "/v1/completions", json=body)
        text = _text(r) if r.status_code == 200 else r.text[:120]
        return r.status_code, text, time.perf_counter() - t0
    except httpx.HTTPError as exc:
        return -1, f"{type(exc).__name__}", time.perf_counter() - t0
    finally:
        if client is None:
            c.close()


def poisoned(url: str) -> dict:
    prompts = ["def main():", "The quick brown", "import os"]
    good = [{"prompt": p, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True} for p in prompts]
    alone = [completion(url, b)[1] for b in good]
    bad = {"prompt": "Hello", "max_tokens": 4, "temperature": 1e-320}
    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(completion, url, b) for b in good]
        time.sleep(0.05)
        poison = pool.submit(completion, url, bad)
        results = [j.result() for j in jobs]
    return {"poison_status": poison.result()[0],
            "others_same_as_alone": [r[1] == a for r, a in zip(results, alone)],
            "others_status": [r[0] for r in results]}


def long_stops(url: str) -> dict:
    small = {"prompt": "import os", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    alone = completion(url, small)[2]
    stops = [c * 250_000 for c in "abcd"]
    big = {"prompt": "The for statement", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop": stops}
    with ThreadPoolExecutor(2) as pool:
        job = pool.submit(completion, url, big)
        time.sleep(0.3)
        concurrent = completion(url, small)
        status, _, seconds = job.result()
    return {"long_stop_status": status, "long_stop_s": round(seconds, 2),
            "small_alone_s": round(alone, 2), "small_concurrent_s": round(concurrent[2], 2)}


def stops_at_bound(url: str) -> dict:
    """Four stop strings as long as the server allows (1000 characters) against none."""
    body = {"prompt": "The for statement", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    plain = completion(url, body)
    stopped = completion(url, {**body, "stop": [c * 1000 for c in "abcd"]})
    return {"no_stops_s": round(plain[2], 2), "stops_1000_chars_s": round(stopped[2], 2),
            "same_text": plain[1] == stopped[1], "status": stopped[0]}


def abandoned(url: str) -> dict:
    probe = {"prompt": "The for statement", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    alone = completion(url, probe)[2]
    long = {"prompt": "def main():", "max_tokens": 240, "temperature": 0, "ignore_eos": True}

    def abandon():
        try:
            httpx.post(url + "/v1/completions", json=long, timeout=0.5)
        except httpx.TimeoutException:
            pass

    threads = [threading.Thread(target=abandon) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = completion(url, probe)
    return {"probe_alone_s": round(alone, 2), "probe_after_abandoned_s": round(after[2], 2), "status": after[0]}


def _raw_wait(url: str, payload: bytes) -> tuple[str, float]:
    """Send ``payload`` and wait for the server to answer or close; ('held', CAP) if neither."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=CAP_S) as s:
        s.sendall(payload)
        t0 = time.perf_counter()
        try:
            data = s.recv(4096)
        except socket.timeout:
            return "held", CAP_S
        seconds = time.perf_counter() - t0
        if not data:
            return "closed", seconds
        return data.split(b"\r\n", 1)[0].decode(errors="replace"), seconds


def slow_clients(url: str) -> dict:
    u = urlparse(url)
    host = f"{u.hostname}:{u.port}".encode()
    half_headers = b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nContent-Ty"
    half_body = (b"POST /v1/completions HTTP/1.1\r\nHost: " + host +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    a, sa = _raw_wait(url, half_headers)
    b, sb = _raw_wait(url, half_body)
    return {"half_headers": a, "half_headers_s": round(sa, 2), "half_body": b, "half_body_s": round(sb, 2)}


VALIDATION = [
    {"prompt": "hi", "seed": -1},
    {"prompt": "hi", "seed": 2 ** 64},
    {"prompt": "hi", "top_k": 10 ** 30},
    {"prompt": "\ud800"},
    {"prompt": "hi", "stop": ["\udfff"]},
    {"prompt": "hi", "temperature": 1e308},
    {"prompt": "hi", "temperature": 1e-320, "max_tokens": 2},
    {"prompt": "hi", "top_p": 1e-320, "temperature": 1.0, "max_tokens": 2},
    {"prompt": [0, -1]},
    {"prompt": [10 ** 40]},
    {"prompt": "hi", "stop": ["x"] * 5},
    {"prompt": "hi", "stream_options": {"include_usage": "yes"}, "stream": True},
]
CHAT_VALIDATION = [
    {"messages": [{"role": "user", "content": "\ud800"}]},
    {"messages": [{"role": "\udc00", "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
]


def _raw_bodies() -> list[bytes]:
    return [b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "\\ud800"}', b'{"prompt": "hi", "max_tokens": 1e999}',
            b"\xff\xfe", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
            b'{"prompt": "hi", "n": ' + b"9" * 5000 + b"}", b'{"prompt": "hi", "seed": ' + b"9" * 30 + b"}"]


def _probe_connection(client: httpx.Client, url: str, send) -> str:
    """Run ``send`` then a normal request on the same client: the outcome class."""
    try:
        r = send()
    except httpx.TimeoutException:
        return "hang"
    except httpx.HTTPError:
        return "dropped"
    status = r.status_code
    if status == 200:
        return "ok"
    try:
        error = r.json()["error"]
        shaped = bool(error["message"]) and bool(error["type"])
    except Exception:
        shaped = False
    if status >= 500:
        kind = "crash"
    elif 400 <= status < 500 and shaped:
        kind = "clear"
    else:
        kind = f"unshaped-{status}"
    try:
        ok = client.post(url + "/v1/completions", json=NORMAL).status_code == 200
    except httpx.HTTPError:
        ok = False
    return kind if ok else kind + "+connection-lost"


def _post_ascii(client: httpx.Client, url: str, path: str, body: dict) -> httpx.Response:
    """JSON with \\u escapes, so lone surrogates travel as a client would send them."""
    return client.post(url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def validation(url: str) -> dict:
    outcomes = []
    with httpx.Client(timeout=CAP_S) as client:
        for body in VALIDATION:
            outcomes.append(_probe_connection(client, url, lambda b=body: _post_ascii(client, url, "/v1/completions", b)))
        for body in CHAT_VALIDATION:
            outcomes.append(_probe_connection(
                client, url, lambda b=body: _post_ascii(client, url, "/v1/chat/completions", b)))
        for raw in _raw_bodies():
            outcomes.append(_probe_connection(client, url, lambda b=raw: client.post(
                url + "/v1/completions", content=b, headers={"content-type": "application/json"})))
    return {"outcomes": outcomes}


def _peak_rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def body_size(url: str, pid: int | None) -> dict:
    out: dict = {"rss_before_mb": _peak_rss_mb(pid)}
    latencies: list[float] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            t0 = time.perf_counter()
            httpx.get(url + "/health", timeout=CAP_S)
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    status, _, seconds = completion(url, {"prompt": "word " * 1_000_000, "max_tokens": 1})
    done.set()
    watcher.join()
    out.update(big_prompt_status=status, big_prompt_s=round(seconds, 2),
               health_max_s=round(max(latencies), 2))

    def chunks():
        piece = b'{"prompt": "' + b"a" * (1 << 20)
        yield piece
        for _ in range(199):
            yield b"a" * (1 << 20)
        yield b'"}'

    with httpx.Client(timeout=CAP_S) as client:
        out["200mb_outcome"] = _probe_connection(client, url, lambda: client.post(
            url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}))
    out["rss_after_mb"] = _peak_rss_mb(pid)
    return out


PROBES = {"poisoned": poisoned, "long_stops": long_stops, "stops_at_bound": stops_at_bound, "abandoned": abandoned, "slow_clients": slow_clients,
          "validation": validation, "body_size": body_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--pid", type=int, default=None, help="the server's pid, for its peak RSS")
    parser.add_argument("--only", default=",".join(PROBES), help="comma-separated probe names")
    args = parser.parse_args()
    for name in args.only.split(","):
        t0 = time.perf_counter()
        result = PROBES[name](args.url, args.pid) if name == "body_size" else PROBES[name](args.url)
        print(json.dumps({"probe": name, "seconds": round(time.perf_counter() - t0, 1), **result}), flush=True)


if __name__ == "__main__":
    main()
