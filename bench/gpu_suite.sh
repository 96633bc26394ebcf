#!/usr/bin/env bash
# The GPU benchmarks of issue 18 in one run on the device (about 8 minutes), logs into $OUT:
#   decode_p128.log    prompt 128, 128 generated: mlx-pte vs mlx-lm, bf16 and q4 g64, 5 interleaved rounds
#   decode_p2048.log   prompt 2048, 64 generated, the same (prefill of a long prompt, default export)
#   profile.log        bench/gpu_profile.py: kernels, kernel ms, wall ms, busy, top kernels per token
#   gemv.log           bench/gpu_gemv.py: GEMV GB/s at the model's shapes, custom kernel, cuBLAS, q4
#   batches.log        --batches 8,32,64: batched-sequence vs mlx-lm's BatchGenerator, bf16
#   decode_whole.log   segments (today's capture) vs the whole step as one compiled function, bf16
#
#   bench/gpu_suite.sh      # on the device, from the repository root; .gpu/ from bench/make_gpu_exports.sh
#
# Needs: .whl/ (MLX's CUDA wheel as cuda.part.NN, the mlx and mlx_lm wheels), .gpu/llama1b-bf16.pte.gz
# and .gpu/llama1b-q4.pte.gz. A step that fails or runs past its time is logged and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu_suite}
SITE=/tmp/site
HF=/tmp/llama1b
mkdir -p "$OUT"
PTES=(--pte bf16=.gpu/llama1b-bf16.pte.gz --pte q4=.gpu/llama1b-q4.pte.gz)
COMMON=(--hf-dir "$HF" --site "$SITE" --work /tmp/gpu_decode)

step() {  # name, seconds, command...
    local name=$1 seconds=$2; shift 2
    echo "== $name: $*" | tee "$OUT/$name.log"
    local t0=$SECONDS
    timeout "$seconds" "$@" >> "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
}

for f in .gpu/llama1b-bf16.pte.gz .gpu/llama1b-q4.pte.gz; do
    [ -f "$f" ] || { echo "error: $f missing: run bench/make_gpu_exports.sh where the exporter runs" >&2; exit 2; }
done
{
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
    # Once: the wheels, the device check and the checkpoint; the steps below reuse them.
    (cd bench && "$PY" -c "
import sys; from pathlib import Path
from gpu_decode import install_mlx, make_checkpoint
install_mlx(Path('../.whl'), Path('$SITE')); make_checkpoint(Path('$HF'))
sys.path.insert(0, '$SITE'); import mlx.core as mx
print('MLX', mx.__version__, 'on', mx.default_device()); sys.exit(mx.default_device() != mx.gpu)")
} > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; echo "error: setup failed (MLX not on the GPU?)" >&2; exit 1; }
cat "$OUT/setup.log"

step decode_p128 150 "$PY" bench/gpu_decode.py "${PTES[@]}" "${COMMON[@]}" --prompt 128 --generate 128 \
    --rounds 5 --capture on --skip hf --skip hf-static
step decode_p2048 120 "$PY" bench/gpu_decode.py "${PTES[@]}" "${COMMON[@]}" --prompt 2048 --generate 64 \
    --rounds 5 --capture on --skip hf --skip hf-static
step profile 90 "$PY" bench/gpu_profile.py "${PTES[@]}" "${COMMON[@]}" --prompt 128 --generate 64
step gemv 60 "$PY" bench/gpu_gemv.py --site "$SITE" --custom --torch --q4
step batches 90 "$PY" bench/gpu_decode.py --pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 \
    --generate 64 --batches 8,32,64
step decode_whole 75 "$PY" bench/gpu_decode.py --pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 \
    --generate 128 --rounds 5 --capture on --whole-step --skip mlx-lm --skip hf --skip hf-static
grep -h -A3 "median of per-round" "$OUT"/decode_*.log
