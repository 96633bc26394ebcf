"""Decode speed of a Qwen3-MoE-shaped model, mlx-pte against mlx-lm, at B=1 and batched.

    # CPU, a small MoE shape, exported in-process:
    .venv/bin/python bench/moe.py --shape small --hf-dir /tmp/moe-small
    # GPU (MLX's CUDA backend), 30B-A3B layer shapes with 4 layers, exported elsewhere:
    .venv/bin/python bench/moe.py --shape 30b-a3b --layers 4 --hf-dir /tmp/moe30 --export-only \
        --pte .gpu/moe30-bf16.pte.gz --dtype bfloat16     # here: writes the checkpoint and the .pte.gz
    python3 bench/moe.py --shape 30b-a3b --layers 4 --hf-dir /root/stash/moe30 \
        --pte .gpu/moe30-bf16.pte.gz --dtype bfloat16 --wheels .whl --batches 1,8,32

The checkpoint's weights are almost all zero (made here if --hf-dir lacks one; it gzips to
little more than its routers, so the .pte travels in the 64 MiB carry): speed does not
depend on the values, except through routing. A zero router would score every expert
alike and send every token of a batch to the same top-k experts, one expert set per layer,
which no trained model does. So the routers are random, the norms are ones, and token t's
embedding is the unit vector at t mod hidden, which the residual stream carries unchanged
(attention and experts add zeros): each token routes its own way in every layer. The head
maps token t to the next token v with 7v = t (mod hidden), so greedy decode walks through
different tokens, and different prompts decode through different expert sets.

``--wheels DIR`` / ``--site`` install MLX's CUDA wheel and mlx, mlx-lm as bench/gpu_setup.py
does. Rounds are interleaved (mlx-pte, mlx-lm, mlx-pte, ...) so drift on a shared machine
hits both; the table gives each engine's median decode tok/s and the median of the
per-round ratios mlx-pte / mlx-lm (> 1: mlx-pte is faster).
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from gpu_setup import REPO, check_mlx_device, gunzip, install_mlx, project_root, zero_weight_model

SHAPES = {
    # Qwen3-30B-A3B's layers: 128 experts of width 768, top 8, GQA 32 over 4 heads of 128.
    "30b-a3b": dict(vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                    num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                    head_dim=128, norm_topk_prob=True),
    # Small enough for a CPU run in a minute or two.
    "small": dict(vocab_size=4096, hidden_size=256, moe_intermediate_size=128, intermediate_size=512,
                  num_experts=16, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=32, norm_topk_prob=True),
}  # fmt: skip


def make_checkpoint(out: Path, shape: str, layers: int) -> Path:
    """A Qwen3-MoE checkpoint of ``shape`` with ``layers`` layers (no download), zero but
    for what spreads routing (``spread_routing``)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if (out / "config.json").exists():
        return out
    config = Qwen3MoeConfig(**SHAPES[shape], num_hidden_layers=layers, max_position_embeddings=4096,
                            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip
    model = zero_weight_model(Qwen3MoeForCausalLM, config)
    with torch.no_grad():
        spread_routing(model, config)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffer was left empty
    model.eval().save_pretrained(out)
    # mlx-lm reads the transformers-4 names, which transformers 5 writes as num_local_experts
    # and rope_parameters; both readers accept the file with them added.
    saved = json.loads((out / "config.json").read_text())
    saved.update(num_experts=config.num_experts, rope_theta=saved["rope_parameters"]["rope_theta"])
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(REPO / "models" / "default" / name, out / name)
    return out


def spread_routing(model, config) -> None:
    """Random routers, unit norms, token t's embedding e_(t mod H) and a head whose greedy
    successor of t is the v with 7v = t (mod H): see the module docstring."""
    import torch

    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.weight.fill_(1.0)
    for layer in model.model.layers:
        router = layer.mlp.gate.weight
        router.copy_(torch.randn(router.shape, generator=generator).to(router.dtype))
    tokens = torch.arange(config.vocab_size)
    model.model.embed_tokens.weight[tokens, tokens % hidden] = 1.0
    model.lm_head.weight[tokens, (7 * tokens) % hidden] = 1.0


def export_gz(model_dir: Path, out: Path, dtype: str) -> Path:
    """Export ``model_dir`` to ``out`` (gzip-compressed when it ends in .gz) with the exporter's
    default step bound, as users export: a bound near the prompt length would cap the
    engine's step budget there and turn batched runs into one prompt per mixed step."""
    from mlx_pte.export.hf_export import export_hf

    plain = out.with_suffix("") if out.suffix == ".gz" else out
    export_hf(model_dir, plain, dtype=dtype, progress=False)
    if plain != out:
        with open(plain, "rb") as src, gzip.open(out, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        plain.unlink()
    return out


def decode_pte(program, prompt: list[int], n: int, dtype: str, launch: str) -> float:
    from mlx_pte import Session, generate

    session = Session(program, capacity=len(prompt) + n, kv_dtype=dtype, launch=launch)
    return generate(session, prompt, max_new_tokens=n, stop_on_eos=False).decode_tps


def decode_mlx_lm(model, prompt: list[int], n: int) -> float:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    first = time.perf_counter()
    for i, _ in zip(range(n), generate_step(mx.array(prompt), model, max_tokens=n)):
        if i == 0:
            first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)


def interleaved(runners: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each runner once per round, in turn; the first round warms up and is dropped."""
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(rounds + 1):
        for name, run in runners.items():
            rate = run()
            if r:
                rates[name].append(rate)
    return rates


def report(title: str, rates: dict[str, list[float]]) -> None:
    pte, lm = rates["mlx-pte"], rates["mlx-lm"]
    ratio = statistics.median(a / b for a, b in zip(pte, lm))
    print(f"{title}: mlx-pte {statistics.median(pte):.2f} tok/s, mlx-lm {statistics.median(lm):.2f} tok/s, "
          f"median ratio {ratio:.3f}x over {len(pte)} rounds", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--hf-dir", type=Path, required=True, help="zero-weight checkpoint; made if missing")
    parser.add_argument("--pte", type=Path, help=".pte or .pte.gz of that checkpoint (default: export in-process)")
    parser.add_argument("--export-only", action="store_true", help="write the checkpoint and --pte, then stop")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--wheels", type=Path, help="MLX CUDA, mlx and mlx-lm wheels to install first")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where wheels are installed")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_moe"), help="scratch folder")
    parser.add_argument("--prompt", type=int, default=64, help="prompt length in tokens")
    parser.add_argument("--generate", type=int, default=32, help="tokens to generate (at least 2)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (after one warm-up)")
    parser.add_argument("--batches", default="1", metavar="B,B,...",
                        help="request counts; B > 1 runs batched-sequence against mlx-lm's BatchGenerator")
    parser.add_argument("--launch", default="inline", choices=["inline", "thread"],
                        help="how mlx-pte launches each step (see README: launchers)")
    args = parser.parse_args()
    if args.generate < 2 or args.rounds < 1 or args.layers < 1:
        parser.error("--generate must be at least 2, --rounds and --layers at least 1")
    if args.export_only and args.pte is None:
        parser.error("--export-only needs --pte (where to write the export)")
    batches = [int(b) for b in args.batches.split(",")]

    args.work.mkdir(parents=True, exist_ok=True)
    if args.wheels:
        install_mlx(args.wheels, args.site)
    sys.path[:0] = [str(args.site), str(project_root(args.work / "src"))]
    model_dir = make_checkpoint(args.hf_dir, args.shape, args.layers)  # imports torch before MLX
    pte = args.pte
    if pte is None or args.export_only:
        pte = export_gz(model_dir, pte or args.work / "model.pte", args.dtype)
        if args.export_only:
            print(f"wrote {pte}")
            return

    import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
    import mlx.core as mx

    import batched  # bench/batched.py: the engine and BatchGenerator runners
    from mlx_pte import load
    from variants import load_mlx_lm

    device = check_mlx_device(args.wheels is not None)
    program = load(gunzip(pte, args.work))
    model = load_mlx_lm(model_dir, args.dtype)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print(f"{args.shape} x {args.layers} layers, {args.dtype}, prompt {args.prompt}, generate {args.generate}, "
          f"mlx-pte launch {args.launch}, "
          f"MLX {mx.__version__} on {device}", flush=True)
    # One warmed engine for every batch size (as serve runs), sized for the largest.
    engine = None
    if max(batches) > 1:
        engine = batched.warmed_engine(program, "batched-sequence", max(batches) * (args.prompt + args.generate),
                                       args.dtype, args.launch)
    for b in batches:
        prompts = batched.prompts_for(b, args.prompt, vocab)
        if b == 1:
            runners = {"mlx-pte": lambda: decode_pte(program, prompts[0], args.generate, args.dtype, args.launch),
                       "mlx-lm": lambda: decode_mlx_lm(model, prompts[0], args.generate)}  # fmt: skip
        else:
            runners = {
                "mlx-pte": lambda: batched.bench_engine(engine, prompts, args.generate).decode_tps,
                "mlx-lm": lambda: batched.bench_mlx_lm(model, prompts, args.generate).decode_tps,
            }  # fmt: skip
        report(f"B={b} decode", interleaved(runners, args.rounds))


if __name__ == "__main__":
    main()
