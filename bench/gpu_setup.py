"""The device machine's setup for the GPU benches: MLX's CUDA wheels installed into a folder,
the checkout importable as the installed ``mlx_pte``, a Llama-3.2-1B-shaped checkpoint with
zero weights, gzipped exports unpacked, and the device (with the host's CPU) checked and
named. The machine's Python has torch (CUDA) and transformers but no MLX.
"""
from __future__ import annotations

import argparse
import gzip
import os
import platform
import shutil
import site
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CUDA_WHEEL = "mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl"

LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
    tie_word_embeddings=True, rope_theta=500000.0, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)


def install_mlx(wheels: Path, target: Path) -> None:
    """Reassemble MLX's split CUDA wheel and install every wheel in ``wheels`` into ``target``;
    nothing to do where ``target`` already holds these wheels (the suite's steps share one)."""
    parts = sorted(wheels.glob("cuda.part.*"))
    stamp = target / ".installed-wheels"
    listing = "\n".join(f"{p.name} {p.stat().st_size}" for p in sorted(wheels.iterdir())
                        if p.is_file() and p.name != CUDA_WHEEL)  # the whole wheel: made below from parts
    if stamp.is_file() and stamp.read_text() == listing:
        return
    if parts:
        with open(wheels / CUDA_WHEEL, "wb") as whole:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, whole)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--upgrade", "--target", str(target), *map(str, sorted(wheels.glob("*.whl")))],
        check=True,
    )
    # libmlx.so finds the CUDA libraries through RPATH $ORIGIN/../../nvidia/*/lib, i.e. next to
    # the install; point that at the nvidia-* packages torch already brings.
    nvidia = target / "nvidia"
    if not nvidia.exists():
        found = [Path(p) / "nvidia" for p in site.getsitepackages() if (Path(p) / "nvidia").is_dir()]
        if found:
            nvidia.symlink_to(found[0], target_is_directory=True)
    stamp.write_text(listing)


def project_root(dest: Path, checkout: Path = REPO) -> Path:
    """A folder holding ``mlx_pte`` laid out as installed (symlinks into ``checkout``)."""
    import tomllib

    checkout = checkout.resolve()
    pkg = dest / "mlx_pte"
    if not pkg.exists():
        shutil.copytree(checkout / "mlx_pte", pkg)
        # The top-level folders pyproject's package-dir maps into the mlx_pte namespace.
        package_dir = tomllib.loads((checkout / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
        for name, folder in package_dir.items():
            if name != "mlx_pte":
                (pkg / name.removeprefix("mlx_pte.")).symlink_to(checkout / folder, target_is_directory=True)
    return dest


def make_checkpoint(out: Path) -> Path:
    """A Llama-3.2-1B-shaped bf16 checkpoint with zero weights (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if (out / "config.json").exists():
        return out
    config = LlamaConfig(**LLAMA_1B)
    model = zero_weight_model(LlamaForCausalLM, config)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # its buffer was left empty
    model.eval().save_pretrained(out)
    tokenizer = REPO / "models" / "default"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer / name, out / name)
    return out


def zero_weight_model(model_class, config):
    """``model_class(config)`` in bfloat16 with every parameter zero, built on the meta device
    so no random initialization runs (its rotary buffers are left empty: the caller rebuilds
    them)."""
    import torch

    with torch.device("meta"):
        model = model_class(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def gunzip(path: Path, work: Path) -> Path:
    """``path`` itself, or its decompressed copy in ``work`` (reused while newer than ``path``)."""
    if not path.is_file():
        raise SystemExit(f"error: {path}: no such file")
    if path.suffix != ".gz":
        return path
    out = work / path.stem
    if out.is_file() and out.stat().st_mtime >= path.stat().st_mtime:
        return out
    partial = out.with_name(out.name + ".part")
    with gzip.open(path, "rb") as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
    os.replace(partial, out)  # whole or absent: a reused copy is never a truncated one
    return out


def check_mlx_device(wheels: bool) -> str:
    """MLX's device and the host's CPU (a host-bound step's ratios move with it), after
    checking that installed wheels did give MLX the GPU."""
    import mlx.core as mx

    device = mx.default_device()
    if wheels and device != mx.gpu:
        raise SystemExit(f"error: MLX {mx.__version__} (from {Path(mx.__file__).parent}) runs on {device}, not the "
                         "GPU: check that --wheels holds MLX's CUDA wheel (mlx_cuda_*, or cuda.part.NN)")
    return f"{device} (host: {host_cpu()}, {os.cpu_count()} threads)"


def host_cpu() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (Linux), else the platform's word."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every device bench shares: checkpoint, wheels, folders, prompt length."""
    parser.add_argument("--group-size", type=int, default=64, help="mlx-lm's group size for q8/q4 (default 64)")
    parser.add_argument("--hf-dir", type=Path, required=True, help="same-shaped HF checkpoint; made if missing")
    parser.add_argument("--wheels", type=Path, help="MLX CUDA, mlx and mlx-lm wheels to install first")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where wheels are installed")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_decode"), help="scratch folder")
    parser.add_argument("--prompt", type=int, default=128, help="prompt length in tokens")
