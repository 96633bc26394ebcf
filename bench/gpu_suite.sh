#!/usr/bin/env bash
# The GPU benchmarks of issue 18 in one run on the device (about 8 minutes), logs into $OUT:
#   decode_p128.log    prompt 128, 128 generated: mlx-pte vs mlx-lm, bf16 and q4 g64, 5 interleaved rounds
#   decode_p2048.log   prompt 2048, 64 generated, the same (prefill of a long prompt, default export)
#   profile.log        bench/gpu_profile.py: kernels, kernel ms, wall ms, busy, top kernels per token
#   profile_b8.log     the same per decode step of 8 requests on batched-sequence, bf16 (mlx-lm's
#                      BatchGenerator under the profiler ended in a segfault, so it is skipped)
#   profile_b8_cell.log  the same for batched-cell
#   gemv.log           bench/gpu_gemv.py: GEMV GB/s at the model's shapes, MLX's, runtime/mlx/gemv.py's kernel
#                      at several tilings, cuBLAS, q4, and the fused norm and GLU against MLX's ops; each
#                      row's wall time and its kernels' own time (profiled); GEMV_ARGS=... adds arguments
#   batches.log        --batches 8,32,64: batched-sequence vs mlx-lm's BatchGenerator, bf16
#   decode_whole.log   segments (today's capture) vs the whole step as one compiled function, bf16
#   kinds.log          --batches 8,32,64 on both batched layouts (sequence vs cell) and mlx-lm, bf16
#   kv_write.log       bench/kv_write.py: a B=32 decode step's K/V writes by form (flat put_along_axis, scatter)
#   moe.log            bench/moe.py: Qwen3-30B-A3B layer shapes x 4 layers, B=1,8,32 vs mlx-lm (needs
#                      .gpu/moe30-bf16.pte.gz, written by bench/moe.py --export-only: see its docstring)
#   launch.log         prompt 128, 128 generated, bf16 and q4: mlx-pte launched inline and on a launcher
#                      thread (--threaded) vs mlx-lm, 5 interleaved rounds; with BASELINE also mlx-pte
#                      from that checkout (a folder, or a tar of one, e.g. `git archive REV | xz`)
#   launch_batches.log --batches 8,32,64: batched-sequence launched inline and on a thread vs mlx-lm
#   kinds_thread.log   kinds, both layouts launched on a thread
#   moe_thread.log     moe, mlx-pte launched on a thread
#   pool_copies.log    bench/pool_copies.py: decode with K/V pools of 512 vs 32,768 slots (whole-pool copies?)
#   decode_kernel.log  kinds_thread, and batched-sequence again with its CUDA decode kernel off (masked SDPA)
#   rope_pairs.log     prompt 128, 128 generated, bf16 and q4: mlx-pte as loaded (q and k rotated together)
#                      and with a rope each (--separate-rope), inline and on a thread, vs mlx-lm
#   linear_forms.log   prompt 128, 128 generated, bf16 and q4, 9 rounds: mlx-pte inline, on a thread, and on a
#                      thread with linear as before its one-node GPU form (mlx-pte-vec), vs mlx-lm; with
#                      BASELINE=CHECKOUT also mlx-pte from that checkout (mlx-pte-base)
#   encode.log         bench/gpu_encode.py: host us per graph node by kind (views, kernels, gemv), MLX's
#                      defaults, then MLX_USE_CUDA_GRAPHS=0
#   gemv_forms.log     prompt 128, 128 generated, bf16 and q4, 9 rounds: mlx-pte with runtime/mlx/gemv.py's
#                      kernels (MLX_PTE_GEMV=1) inline and on a thread, on a thread with MLX's ops for one-row
#                      linears and their norms and GLUs (mlx-pte-mlxgemv), without the fused norm
#                      (mlx-pte-nonorm), without the fused GLU (mlx-pte-noglu), and with every kernel at the
#                      tilings GEMV_TILINGS names (default "4,2,4 16,1,4": 2 rows a warp, which shares x's
#                      conversion in 4 bits, and 16 warps a block, half the blocks building a fused row;
#                      rows mlx-pte-t4x2x4, -t16x1x4), vs mlx-lm; with BASELINE=CHECKOUT also mlx-pte from
#                      that checkout (mlx-pte-base). Other steps run the kernels where the caller sets
#                      MLX_PTE_GEMV=1
#   gpu_tests.log      the tests that run only on CUDA (tests/runtime/mlx/test_decode_attention.py,
#                      test_gemv.py, test_glu_gemv.py; GPU_TESTS=FILES for some), on the GPU: the default cases;
#                      GPU_MARK=slow runs test_gemv's other kernel combinations instead, in a call of
#                      their own (each case compiles its kernel, about 2.5 s on an H100 host)
#   profile_b64.log    per decode step of 64 requests (launch thread, the GPU's default): batched-sequence,
#                      the same with its decode kernel off (masked SDPA), and batched-cell
#   graphs_off.log     prompt 128, 128 generated, bf16: mlx-pte inline and on a thread with MLX_USE_CUDA_GRAPHS=0
#                      (each kernel launched on its own) vs mlx-lm in a process of its own with MLX's defaults
#   graphs_on.log      the same with MLX's defaults, one process (the baseline of the two steps around it)
#   ops_per_graph.log  the same with MLX_MAX_OPS_PER_BUFFER=250 (MLX's default on H100/H200: 100 kernels a graph)
#
#   bench/gpu_suite.sh      # on the device, from the repository root; .gpu/ from bench/make_gpu_exports.sh
#   STEPS="kinds moe" bench/gpu_suite.sh    # only the steps named (default: all but kinds, moe, their
#                                           # _thread forms and the launch steps)
#   STEPS="launch launch_batches pool_copies" bench/gpu_suite.sh   # the launchers (about 6 minutes)
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

STEPS=${STEPS:-decode_p128 decode_p2048 profile gemv batches decode_whole}
if [[ "${BASELINE:-}" == *.tar* ]]; then  # a packed checkout (smaller to carry to the device)
    mkdir -p /tmp/baseline && tar -xf "$BASELINE" -C /tmp/baseline && BASELINE=/tmp/baseline
fi

step() {  # name, seconds, command...
    local name=$1 seconds=$2; shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
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
from gpu_setup import check_mlx_device, install_mlx, make_checkpoint, project_root
install_mlx(Path('../.whl'), Path('$SITE')); make_checkpoint(Path('$HF')); project_root(Path('/tmp/gpu_decode/src'))
sys.path.insert(0, '$SITE'); import mlx.core as mx
print('MLX', mx.__version__, 'on', check_mlx_device(wheels=True))")
} > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; echo "error: setup failed (MLX not on the GPU?)" >&2; exit 1; }
cat "$OUT/setup.log"

step decode_p128 150 "$PY" bench/gpu_decode.py "${PTES[@]}" "${COMMON[@]}" --prompt 128 --generate 128 \
    --rounds 5 --capture on --skip hf --skip hf-static
step decode_p2048 120 "$PY" bench/gpu_decode.py "${PTES[@]}" "${COMMON[@]}" --prompt 2048 --generate 64 \
    --rounds 5 --capture on --skip hf --skip hf-static
step profile 150 "$PY" bench/gpu_profile.py "${PTES[@]}" "${COMMON[@]}" --prompt 128 --generate 64
step profile_b8 120 "$PY" bench/gpu_profile.py --pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 \
    --generate 32 --batch 8 --top 24 --skip mlx-lm
step profile_b8_cell 90 "$PY" bench/gpu_profile.py --pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 \
    --generate 32 --batch 8 --top 24 --kind batched-cell --skip mlx-lm
step gemv 420 "$PY" bench/gpu_gemv.py --site "$SITE" --torch --q4 --kernel-time ${GEMV_ARGS:-}
step batches 90 "$PY" bench/gpu_decode.py --pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 \
    --generate 64 --batches 8,32,64
step decode_whole 75 "$PY" bench/gpu_decode.py --pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 \
    --generate 128 --rounds 5 --capture on --whole-step --skip mlx-lm --skip hf --skip hf-static
step kinds 240 "$PY" bench/gpu_decode.py --pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 \
    --generate 64 --batches 8,32,64 --kinds batched-sequence,batched-cell
step kv_write 60 "$PY" bench/kv_write.py --site "$SITE"
step moe 300 "$PY" bench/moe.py --shape 30b-a3b --layers 4 --hf-dir /tmp/moe30 --pte .gpu/moe30-bf16.pte.gz \
    --dtype bfloat16 --site "$SITE" --work /tmp/bench_moe --batches 1,8,32
step launch 240 "$PY" bench/gpu_decode.py "${PTES[@]}" "${COMMON[@]}" --prompt 128 --generate 128 \
    --rounds 5 --capture on --threaded ${BASELINE:+--baseline "$BASELINE"} --skip hf --skip hf-static
step launch_batches 240 "$PY" bench/gpu_decode.py --pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 \
    --generate 64 --batches 8,32,64 --launch inline,thread
step kinds_thread 240 "$PY" bench/gpu_decode.py --pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 \
    --generate 64 --batches 8,32,64 --kinds batched-sequence,batched-cell --launch thread
step moe_thread 300 "$PY" bench/moe.py --shape 30b-a3b --layers 4 --hf-dir /tmp/moe30 --pte .gpu/moe30-bf16.pte.gz \
    --dtype bfloat16 --site "$SITE" --work /tmp/bench_moe --batches 1,8,32 --launch thread
step pool_copies 90 "$PY" bench/pool_copies.py .gpu/llama1b-bf16.pte.gz --site "$SITE"
step decode_kernel 300 "$PY" bench/gpu_decode.py --pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 \
    --generate 64 --batches 8,32,64 --kinds batched-sequence,batched-cell --launch thread --masked-decode
step rope_pairs 200 "$PY" bench/gpu_decode.py "${PTES[@]}" "${COMMON[@]}" --prompt 128 --generate 128 \
    --rounds 5 --capture on --threaded --separate-rope --skip hf --skip hf-static
B64=(--pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 --generate 16 --batch 64 --top 16
     --skip mlx-lm --launch thread)
step profile_b64 300 bash -c '"$@" && "$@" --masked-decode && "$@" --kind batched-cell' _ \
    "$PY" bench/gpu_profile.py "${B64[@]}"
BF16_LAUNCH=(--pte bf16=.gpu/llama1b-bf16.pte.gz "${COMMON[@]}" --prompt 128 --generate 128 --rounds 5
             --capture on --threaded --skip hf --skip hf-static)
step graphs_off 180 "$PY" bench/gpu_decode.py "${BF16_LAUNCH[@]}" --pte-env MLX_USE_CUDA_GRAPHS=0
step graphs_on 150 "$PY" bench/gpu_decode.py "${BF16_LAUNCH[@]}"
step ops_per_graph 180 "$PY" bench/gpu_decode.py "${BF16_LAUNCH[@]}" --pte-env MLX_MAX_OPS_PER_BUFFER=250
step linear_forms 240 "$PY" bench/gpu_decode.py "${PTES[@]}" "${COMMON[@]}" --prompt 128 --generate 128 \
    --rounds 9 --capture on --threaded --vector-linear ${BASELINE:+--baseline "$BASELINE"} --skip hf --skip hf-static
step gemv_forms 420 env MLX_PTE_GEMV=1 "$PY" bench/gpu_decode.py "${PTES[@]}" "${COMMON[@]}" --prompt 128 --generate 128 \
    --rounds 9 --capture on --threaded --mlx-gemv $(printf -- '--gemv-tiling %s ' ${GEMV_TILINGS:-4,2,4 16,1,4}) \
    ${BASELINE:+--baseline "$BASELINE"} --skip hf --skip hf-static
step encode 120 bash -c '"$@" && MLX_USE_CUDA_GRAPHS=0 "$@"' _ "$PY" bench/gpu_encode.py --site "$SITE"
# pytest and hypothesis come as wheels in .whl/ with MLX's; --noconftest: the suite's fixtures need the
# exporter; -P and append: the checkout's own mlx_pte/ (a shim) must not shadow the installed layout.
step gpu_tests 540 env PYTHONPATH="$SITE:/tmp/gpu_decode/src" "$PY" -P -m pytest -q -p no:cacheprovider --noconftest \
    --import-mode=append -m "${GPU_MARK:-not slow}" \
    ${GPU_TESTS:-tests/runtime/mlx/test_gemv.py tests/runtime/mlx/test_glu_gemv.py tests/runtime/mlx/test_decode_attention.py}
grep -h -A3 "median of per-round" "$OUT"/decode_*.log
