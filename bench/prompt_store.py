"""What a prompt-store lookup costs: ``PromptStore.matches`` over stores of growing size.

    .venv/bin/python bench/prompt_store.py

Each store is filled with conversations of ``--length`` tokens that share a system
prompt (the worst case for a prefix scan: every entry matches at length); the query
continues one of them. Printed: microseconds per lookup, to compare with one forward
(milliseconds). Figures of a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import random
import time

from mlx_pte.serving.engine.prompt_store import PromptStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2048, help="tokens per retained conversation")
    parser.add_argument("--system", type=int, default=512, help="tokens of the shared system prompt")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(0)
    system = [rng.randrange(50_000) for _ in range(args.system)]
    print(f"{'entries':>8} {'tokens':>9} {'us/lookup':>10}")
    for entries in (1, 8, 32, 128):
        store = PromptStore(entries * args.length, lambda seq_id: None)
        conversations = []
        for i in range(entries):
            tokens = system + [rng.randrange(50_000) for _ in range(args.length - args.system)]
            conversations.append(tokens)
            store.add(i, tokens, args.system)
        query = conversations[entries // 2] + [1, 2, 3]
        start = time.perf_counter()
        for _ in range(args.repeats):
            best = store.matches(query)[0]
        seconds = (time.perf_counter() - start) / args.repeats
        assert best.length == args.length
        print(f"{entries:>8} {store.tokens:>9} {1e6 * seconds:>10.0f}")


if __name__ == "__main__":
    main()
