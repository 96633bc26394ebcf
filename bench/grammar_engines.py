"""Grammar engines for structured output, measured on a real tokenizer: compile time and
per-token mask time.

For each engine (llguidance, xgrammar, outlines-core; each in its own process, so one's
threads and caches do not touch another's) and each grammar (``json_object`` and a few
JSON schemas) it compiles the grammar, then walks one valid document token by token:
computing the allowed-token bitmask (a packed int32 ``[ceil(V / 32)]`` row, the form the
device sampler takes), then advancing by the document's next token. Reported: the
tokenizer setup (once per server), compile time per grammar, and the mask time per token
(median, p95) — the host work each constrained token costs before its draw.

    .venv/bin/python bench/grammar_engines.py [--tokenizer DIR] [--repeat 3]

``--tokenizer`` is a checkpoint directory with ``tokenizer.json`` (default: SmolLM2-135M's,
vocab 49152, built by ``tests/fixtures/smollm2.py``). Engines that are not installed are
listed as such (only llguidance is a dependency: ``pip install xgrammar outlines-core``
to compare; xgrammar's row needs transformers too). The serving side may not import torch: an engine whose import needs it is
marked so (its figures are measured with torch allowed, for comparison only).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

DEFAULT_TOKENIZER = Path(os.environ.get("MLX_PTE_CACHE", Path.home() / ".cache" / "mlx-pte")) / "smollm2-135m"
ENGINES = ("llguidance", "xgrammar", "outlines-core")

# name -> (schema or None for json_object, a document it accepts)
GRAMMARS: dict[str, tuple[object, object]] = {
    "json_object": (None, {"name": "Ada", "tags": ["x", "y"], "n": 3, "ok": True, "inner": {"z": None}}),
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Grace Hopper", "age": 85, "email": "grace@example.com"},
    ),
    "nested_enum_array": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "status": {"enum": ["pending", "shipped", "delivered"]},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                },
                "address": {
                    "type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"],
                    "additionalProperties": False,
                },
            },
            "required": ["id", "status", "items", "address"],
            "additionalProperties": False,
        },
        {
            "id": 1042,
            "status": "shipped",
            "items": [{"sku": "A-17", "qty": 2}, {"sku": "B-3", "qty": 1}],
            "address": {"street": "1 Main St", "city": "Springfield"},
        },
    ),
    "numbers_bools_anyof": (
        {
            "type": "object",
            "properties": {
                "score": {"type": "number"},
                "passed": {"type": "boolean"},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "ranks": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
            },
            "required": ["score", "passed", "note", "ranks"],
            "additionalProperties": False,
        },
        {"score": 0.875, "passed": True, "note": None, "ranks": [3, 1, 2]},
    ),
}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable stand-in of each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _token_bytes(tokenizer_json: dict) -> dict[int, bytes]:
    """Each token's bytes, for a byte-level BPE vocabulary (added tokens as their text)."""
    decoder = _byte_decoder()
    out = {i: bytes(decoder[c] for c in tok) for tok, i in tokenizer_json["model"]["vocab"].items()}
    for added in tokenizer_json["added_tokens"]:
        out[added["id"]] = added["content"].encode()
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class _Engine:
    """One engine behind three calls: compile a grammar, compute a mask, advance."""

    def __init__(self, name: str, tokenizer_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.name = name
        path = tokenizer_dir / "tokenizer.json"
        self.hf = Tokenizer.from_file(str(path))
        self.vocab = self.hf.get_vocab_size()
        self.words = (self.vocab + 31) // 32
        self.eos = self.hf.token_to_id("<|im_end|>") or self.hf.token_to_id("<|endoftext|>") or 0
        self.torch_free = True
        t0 = time.perf_counter()
        getattr(self, f"_setup_{name.replace('-', '_')}")(path)
        self.setup_seconds = time.perf_counter() - t0

    # -- llguidance ---------------------------------------------------------------------
    def _setup_llguidance(self, path: Path) -> None:
        sys.modules["torch"] = None  # type: ignore[assignment]  (proves the path needs no torch)
        import llguidance
        import llguidance.numpy as llnp

        self._llg = llguidance
        self._tok = llguidance.LLTokenizer(path.read_text(), n_vocab=self.vocab, eos_token=self.eos)
        self._mask = llnp.allocate_token_bitmask(1, self.vocab)
        self._fill = llnp.fill_next_token_bitmask

    def _compile_llguidance(self, schema):
        llg = self._llg
        grammar = llg.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"})
        matcher = llg.LLMatcher(self._tok, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def _mask_llguidance(self, matcher) -> None:
        self._fill(matcher, self._mask, 0)

    def _advance_llguidance(self, matcher, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()

    # -- xgrammar ------------------------------------------------------------------------
    def _setup_xgrammar(self, path: Path) -> None:
        self.torch_free = False  # `import xgrammar` imports torch
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab, stop_token_ids=[self.eos])
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._mask = xgr.allocate_token_bitmask(1, self.vocab)

    def _compile_xgrammar(self, schema):
        if schema is None:
            compiled = self._compiler.compile_builtin_json_grammar()
        else:
            compiled = self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        return self._xgr.GrammarMatcher(compiled)

    def _mask_xgrammar(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self._mask, 0)

    def _advance_xgrammar(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    # -- outlines-core -------------------------------------------------------------------
    def _setup_outlines_core(self, path: Path) -> None:
        sys.modules["torch"] = None  # type: ignore[assignment]
        import numpy as np
        import outlines_core as oc

        by_bytes: dict[bytes, list[int]] = {}
        for i, b in _token_bytes(json.loads(path.read_text())).items():
            if i != self.eos:
                by_bytes.setdefault(b, []).append(i)
        self._oc = oc
        self._vocabulary = oc.Vocabulary(self.eos, by_bytes)
        self._mask = np.zeros(self.words, dtype=np.int32)

    def _compile_outlines_core(self, schema):
        oc = self._oc
        # A regex engine: json_object is approximated by {"type": "object"}'s regex (bounded nesting).
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema if schema is not None else {"type": "object"}))
        return oc.Guide(oc.Index(regex, self._vocabulary))

    def _mask_outlines_core(self, guide) -> None:
        guide.write_mask_into(self._mask.ctypes.data, self._mask.size, 4)

    def _advance_outlines_core(self, guide, token: int) -> bool:
        guide.advance(token)
        return True

    # -- the walk ------------------------------------------------------------------------
    def run(self, grammar: str, repeat: int) -> dict:
        schema, document = GRAMMARS[grammar]
        text = json.dumps(document, separators=(",", ":"))
        tokens = self.hf.encode(text).ids
        key = self.name.replace("-", "_")
        compile_: Callable = getattr(self, f"_compile_{key}")
        mask: Callable = getattr(self, f"_mask_{key}")
        advance: Callable = getattr(self, f"_advance_{key}")
        compiles, masks, advances = [], [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            matcher = compile_(schema)
            mask(matcher)  # the first mask: part of what a request waits for before its first token
            compiles.append(time.perf_counter() - t0)
            for i, token in enumerate(tokens):
                t0 = time.perf_counter()
                if i:
                    mask(matcher)
                t1 = time.perf_counter()
                if not advance(matcher, token):
                    raise RuntimeError(f"{self.name} refused token {i} ({self.hf.decode([token])!r}) of {text!r}")
                t2 = time.perf_counter()
                if i:
                    masks.append(t1 - t0)
                advances.append(t2 - t1)
        return {
            "grammar": grammar,
            "doc_tokens": len(tokens),
            "compile_ms": statistics.median(compiles) * 1e3,
            "mask_us_median": statistics.median(masks) * 1e6,
            "mask_us_p95": _percentile(masks, 0.95) * 1e6,
            "advance_us_median": statistics.median(advances) * 1e6,
        }


def _one_engine(name: str, tokenizer_dir: Path, repeat: int) -> dict:
    try:
        engine = _Engine(name, tokenizer_dir)
    except ImportError as exc:
        return {"engine": name, "error": f"not usable: {exc}"}
    rows = []
    for grammar in GRAMMARS:
        try:
            rows.append(engine.run(grammar, repeat))
        except Exception as exc:  # one grammar an engine cannot take is a result too
            rows.append({"grammar": grammar, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
    return {"engine": name, "setup_s": engine.setup_seconds, "torch_free": engine.torch_free, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.engine:
        print(json.dumps(_one_engine(args.engine, args.tokenizer, args.repeat)))
        return
    print(f"tokenizer {args.tokenizer}, repeat {args.repeat}")
    print(f"{'engine':14} {'grammar':20} {'compile ms':>10} {'mask us p50':>11} {'p95':>8} {'advance us':>10} {'tokens':>6}")
    for name in ENGINES:
        child = subprocess.run(
            [sys.executable, __file__, "--engine", name, "--tokenizer", str(args.tokenizer), "--repeat", str(args.repeat)],
            capture_output=True, text=True,
        )
        if child.returncode:
            print(f"{name:14} failed: {child.stderr.strip().splitlines()[-1] if child.stderr.strip() else child.returncode}")
            continue
        result = json.loads(child.stdout.strip().splitlines()[-1])
        if "error" in result:
            print(f"{name:14} {result['error']}")
            continue
        note = "" if result["torch_free"] else "  (imports torch: not usable on the serving side)"
        print(f"{name:14} tokenizer setup {result['setup_s'] * 1e3:.0f} ms{note}")
        for row in result["rows"]:
            if "error" in row:
                print(f"{'':14} {row['grammar']:20} {row['error']}")
                continue
            print(
                f"{'':14} {row['grammar']:20} {row['compile_ms']:10.1f} {row['mask_us_median']:11.1f} "
                f"{row['mask_us_p95']:8.1f} {row['advance_us_median']:10.1f} {row['doc_tokens']:6d}"
            )


if __name__ == "__main__":
    main()
