"""Export tiny checkpoints with upstream ExecuTorch's own LLM exporter, in this process.

Run by the fixtures in a subprocess (``python -m tests.upstream.export_upstream OUT SPEC...``,
SPEC = ``family:variant:checkpoint_dir``), so upstream's global registrations (its attention
function, its cache registry) never meet mlx-pte's exporter in the test process.

A variant is a dtype (``fp32``, ``fp16``, ``bf16``), optionally with a quantization of
every linear and embedding weight (``bf16-4w``, ``fp32-8w``, ``fp32-nvfp4``: the exporter's
``--qlinear`` / ``--qembedding``). A quantized export also writes the oracle's weights,
``{family}_{variant}.dequantized.pt``: each weight upstream's quantizer (torchao) quantized,
dequantized by torchao itself, by parameter name, from the very model that was exported.
"""
from __future__ import annotations

import sys
from pathlib import Path

MAX_CONTEXT = 64
# The most tokens a forward takes; upstream requires it not to exceed a sliding window.
CHUNK = {"llama": 8, "qwen3": 8, "gemma3": 4}


def dequantized_path(pte: Path) -> Path:
    """Where the oracle's weights of the quantized export ``pte`` are written."""
    return pte.with_name(f"{pte.stem}.dequantized.pt")


def main(out_dir: str, *specs: str) -> None:
    import torch
    import executorch.backends.mlx.llm.quantization as upstream_quantization
    from executorch.backends.mlx.examples.llm.export_llm_hf import export_llama_hf
    from torchao.utils import TorchAOBaseTensor

    quantize = upstream_quantization.quantize_model_
    for spec in specs:
        family, variant, checkpoint = spec.split(":", 2)
        dtype, _, quantization = variant.partition("-")
        dequantized: dict[str, torch.Tensor] = {}

        def quantize_and_record(model, **kwargs) -> None:
            quantize(model, **kwargs)
            dequantized.update({
                name: value.dequantize().float()
                for name, value in model.state_dict().items() if isinstance(value, TorchAOBaseTensor)
            })  # fmt: skip

        # The exporter imports quantize_model_ from this module when it runs.
        upstream_quantization.quantize_model_ = quantize_and_record
        export_llama_hf(
            model_id=checkpoint,
            revision=None,
            output_path=str(Path(out_dir) / f"{family}_{variant}.pte"),
            max_ctx_len=MAX_CONTEXT,
            dtype=dtype,
            qlinear=quantization or None,
            qembedding=quantization or None,
            use_offgraph_cache=True,
            prefill_chunk_size=CHUNK[family],
        )
        if quantization:
            assert dequantized, f"upstream's quantizer left {variant} without quantized weights"
            torch.save(dequantized, dequantized_path(Path(out_dir) / f"{family}_{variant}.pte"))


if __name__ == "__main__":
    main(*sys.argv[1:])
