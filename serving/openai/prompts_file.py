"""``mlx-pte run MODEL.pte --prompts FILE``: a file of prompts through the batching engine.

The file holds one prompt per line, or JSONL: one OpenAI-style body per line
(``{"prompt": ...}`` or ``{"messages": [...]}`` plus any of ``max_tokens``,
``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``n``). A file is JSONL when its
first non-blank line is a JSON object. Every line is checked before anything runs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, TextIO

from ..engine import Engine, EngineError, EngineStats, RequestHandle
from .request import ApiError, parse_request


class PromptsFileError(ValueError):
    """A prompts file that cannot run; the message names the file and line."""


def read_prompts(path: Path, defaults: Mapping[str, Any]) -> list[tuple[int, dict]]:
    """``(line number, request body)`` for each non-blank line, ``defaults`` under each."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PromptsFileError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise PromptsFileError(f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise PromptsFileError(f"{path} holds no prompts")
    jsonl = _as_object(numbered[0][1]) is not None
    bodies = []
    for number, line in numbered:
        if not jsonl:
            bodies.append((number, {**defaults, "prompt": line}))
            continue
        body = _as_object(line)
        if body is None:
            raise PromptsFileError(f"{path}:{number}: expected a JSON object (the file's first line is one)")
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise PromptsFileError(f"{path}:{number}: the line holds a lone surrogate escape (such as "
                                   "\\ud800), which is not text; fix the line") from None
        bodies.append((number, {**defaults, **body}))
    return bodies


def _as_object(line: str) -> Optional[dict]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def run_prompts_file(engine: Engine, path: Path, defaults: Optional[Mapping[str, Any]] = None,
                     out: TextIO = sys.stdout) -> EngineStats:
    """Run every prompt in ``path`` at once; print each completion, then the aggregate speed.

    Args:
        defaults: request fields applied to every line (a JSONL line overrides them).
    Returns:
        The engine's totals.
    Raises:
        PromptsFileError: an unreadable file or a bad line (nothing has run).
    """
    requests = []
    for number, body in read_prompts(path, defaults or {}):
        try:
            parsed = parse_request(body, engine.text, chat="messages" in body)
        except ApiError as exc:
            raise PromptsFileError(f"{path}:{number}: {exc.message}") from None
        if parsed.request.logprobs is not None:  # refused, not dropped: the printout has no place for them
            raise PromptsFileError(f"{path}:{number}: 'logprobs' are not printed by run --prompts; remove it")
        requests.append((number, parsed.request))
    handles: list[tuple[int, RequestHandle]] = []
    for number, request in requests:
        try:
            handles.append((number, engine.submit(request)))
        except EngineError as exc:
            raise PromptsFileError(f"{path}:{number}: {exc}") from None
    engine.run()
    for number, handle in handles:
        completion = handle.result(timeout=0)
        for sample in completion.samples:
            label = f"line {number}" + (f" sample {sample.index}" if len(completion.samples) > 1 else "")
            print(f"--- {label} ({completion.prompt_tokens} prompt tokens, {len(sample.tokens)} generated, "
                  f"{sample.finish_reason})", file=out)
            print(sample.text, file=out)
    stats = engine.stats
    print(
        f"=== {len(handles)} requests: {stats.prompt_tokens} prompt + {stats.generated_tokens} generated tokens "
        f"in {stats.busy_seconds:.2f} s; decode {stats.decode_tps:.1f} tok/s "
        f"(mean batch {stats.mean_decode_batch:.1f}), overall {stats.throughput_tps:.1f} tok/s",
        file=out,
    )
    return stats
