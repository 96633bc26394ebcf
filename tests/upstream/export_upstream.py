"""Export tiny checkpoints with upstream ExecuTorch's own LLM exporter, in this process.

Run by the fixtures in a subprocess (``python -m tests.upstream.export_upstream OUT SPEC...``,
SPEC = ``family:dtype:checkpoint_dir``), so upstream's global registrations (its attention
function, its cache registry) never meet mlx-pte's exporter in the test process.
"""
from __future__ import annotations

import sys
from pathlib import Path

MAX_CONTEXT = 64
# The most tokens a forward takes; upstream requires it not to exceed a sliding window.
CHUNK = {"llama": 8, "qwen3": 8, "gemma3": 4}


def main(out_dir: str, *specs: str) -> None:
    from executorch.backends.mlx.examples.llm.export_llm_hf import export_llama_hf

    for spec in specs:
        family, dtype, checkpoint = spec.split(":", 2)
        export_llama_hf(
            model_id=checkpoint,
            revision=None,
            output_path=str(Path(out_dir) / f"{family}_{dtype}.pte"),
            max_ctx_len=MAX_CONTEXT,
            dtype=dtype,
            use_offgraph_cache=True,
            prefill_chunk_size=CHUNK[family],
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
