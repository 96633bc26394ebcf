#!/usr/bin/env bash
# The exports bench/gpu_suite.sh runs on the device, made here (where torch/executorch
# are) with the current exporter and its defaults (no --max-step): a Llama-3.2-1B-shaped
# checkpoint with zero weights (bench/gpu_setup.py's make_checkpoint), exported in
# bfloat16 and q4 (group 64), gzipped (zeros compress to almost nothing) into .gpu/.
#
#   bench/make_gpu_exports.sh            # .gpu/llama1b-bf16.pte.gz, .gpu/llama1b-q4.pte.gz
#   CKPT=DIR OUT_DIR=DIR NAME=tiny bench/make_gpu_exports.sh   # another checkpoint (tests)
#
# Each file is written to a temporary name and renamed, so .gpu/ holds whole files only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT_DIR=${OUT_DIR:-.gpu}
NAME=${NAME:-llama1b}
# The checkpoint stays out of the repository: the device makes its own (--hf-dir).
CKPT=${CKPT:-/tmp/make_gpu_exports/$NAME}
mkdir -p "$OUT_DIR" "$(dirname "$CKPT")"
if [ ! -f "$CKPT/config.json" ]; then
    (cd bench && "../$PY" -c "import sys; from pathlib import Path; from gpu_setup import make_checkpoint; make_checkpoint(Path(sys.argv[1]))" "$CKPT")
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export_one() {  # label, then extra export flags
    local label=$1; shift
    "$PY" -m mlx_pte export "$CKPT" -o "$work/$NAME-$label.pte" --dtype bfloat16 --no-progress "$@"
    gzip -1 -c "$work/$NAME-$label.pte" > "$work/$NAME-$label.pte.gz"
    mv "$work/$NAME-$label.pte.gz" "$OUT_DIR/$NAME-$label.pte.gz"
    echo "wrote $OUT_DIR/$NAME-$label.pte.gz ($(du -h "$OUT_DIR/$NAME-$label.pte.gz" | cut -f1))"
}
export_one bf16
export_one q4 --quantize q4 --group-size 64
