#!/usr/bin/env bash
# Follow-up of a GPU run (scripts/gpu_run.sh) that failed: isolates its failures and splits the
# Triton path's host cost per capture, in one command under 6 minutes, with no package index:
#
#   bash scripts/gpu_diagnose.sh        # writes into $OUT (default: benchmarks/gpu/)
#
# The first H200 run (benchmarks/gpu/gpu_run_2026-12-04_*.log) left two failures: gpu_check's aoti
# phase killed the process (SIGSEGV) after the reduce_overhead and persist phases, and on the
# native path the Triton kernel of the native_cuda_kernel phase failed to compile (an fp16 variant,
# in Triton's ConvertTritonGPUToLLVM pass) after the eager and cuda_graph phases. Each step below
# runs in a fresh process with an empty Triton cache (every kernel compiles again), under
# `timeout`, with Python's faulthandler on (a crash prints every thread's Python stack):
#   1. the Triton path (no native library) compiles every capture kernel variant of fp16, bf16,
#      fp32 and int64 (compiledump.prepare_kernels);
#   2. the same with the native library loaded (the Triton kernel still serving CUDA captures);
#   3. gpu_check --only native_cuda_kernel on the native path, as the first phase of its process;
#   4. gpu_check --only eager cuda_graph native_cuda_kernel on the native path (the failed order);
#   5. benchmarks/gpu_host_split.py: host µs per capture call, layer by layer (Triton path);
#   6. gpu_check --only eager aoti compiled_default (Triton path): aoti without the phases before it;
#   7. gpu_check --only eager persist aoti (Triton path), where time is left.
# The native library is the one in compiledump/, or, where there is none, .gpu/libcompiledump_native.so
# copied there (built elsewhere for this torch and GPU; `run`'s carry brings it). Steps that need
# it say so when it is absent.
# Files: $OUT/gpu_diag_<date>_torch<v>_triton<v>.log, and the JSON of steps 3-7 beside it.
# Settings: OUT; GPU_DIAG_BUDGET (seconds for everything, default 330); PYTHON.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
BUDGET=${GPU_DIAG_BUDGET:-330}
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-$PWD/benchmarks/gpu}
mkdir -p "$OUT" || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 COMPILEDUMP_SIGNALS=0
versions=$("$PY" -c 'import torch, triton; print(torch.__version__.replace("+", "-"), triton.__version__)' 2>/dev/null)
read -r TORCH_V TRITON_V <<<"${versions:-unknown unknown}"
STEM="$(date -u +%F)_torch${TORCH_V}_triton${TRITON_V}"
exec > >(tee -a "$OUT/gpu_diag_$STEM.log") 2>&1
echo "== gpu_diagnose $(date -u +%FT%TZ); commit $(git rev-parse --short HEAD 2>/dev/null); budget ${BUDGET} s"
# A library built elsewhere, carried in .gpu/: used where the checkout has none (never over a build).
if [ -f .gpu/libcompiledump_native.so ] && [ ! -e compiledump/libcompiledump_native.so ]; then
    cp .gpu/libcompiledump_native.so compiledump/
fi

step() {  # name limit command...: one fresh process, a fresh Triton cache, within the budget
    local name=$1 limit=$2 left=$((BUDGET - SECONDS))
    shift 2
    if [ "$left" -lt 25 ]; then
        echo "== $name: skipped (${left} s of the budget left)"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (timeout ${limit} s)"
    local started=$SECONDS cache
    cache=$(mktemp -d)
    TRITON_CACHE_DIR=$cache timeout -k 5 "$limit" "$@"
    echo "== $name: exit $? after $((SECONDS - started)) s"
    rm -rf "$cache"
}
prepare='import sys, time, torch, compiledump
print("native library loaded:", compiledump.native_available())
for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int64):
    begun = time.perf_counter()
    try:
        compiledump.prepare_kernels("cuda", (dtype,))
        print(f"{dtype}: compiled ({time.perf_counter() - begun:.1f} s)")
    except Exception as error:
        print(f"{dtype}: FAILED {type(error).__name__}: {str(error).splitlines()[-1][:300]}")'
native_ok=$(COMPILEDUMP_NATIVE=1 COMPILEDUMP_CUDA_KERNEL=native "$PY" -c 'from compiledump.ops import register
print("yes" if register.native_owns_capture("cuda") else "no")' 2>&1 | tail -n 1)
echo "native library serves CUDA captures: $native_ok"

step prepare_triton_path 60 env COMPILEDUMP_NATIVE=0 "$PY" -c "$prepare"
if [ "$native_ok" = yes ]; then
    step prepare_native_loaded 60 env COMPILEDUMP_NATIVE=1 "$PY" -c "$prepare"
    step native_kernel_alone 60 env COMPILEDUMP_NATIVE=1 COMPILEDUMP_CUDA_KERNEL=native "$PY" scripts/gpu_check.py \
        --device cuda --only native_cuda_kernel --out "$OUT/gpu_diag_native_alone_$STEM.json"
    step native_after_graphs 70 env COMPILEDUMP_NATIVE=1 COMPILEDUMP_CUDA_KERNEL=native "$PY" scripts/gpu_check.py \
        --device cuda --only eager cuda_graph native_cuda_kernel --out "$OUT/gpu_diag_native_order_$STEM.json"
else
    echo "== native steps skipped: no native library serves CUDA captures here ($native_ok)"
fi
step host_split 60 env COMPILEDUMP_NATIVE=0 "$PY" benchmarks/gpu_host_split.py --device cuda \
    --out "$OUT/gpu_diag_host_split_$STEM.json"
step aoti_alone 170 env COMPILEDUMP_NATIVE=0 "$PY" scripts/gpu_check.py --device cuda \
    --only eager aoti compiled_default --out "$OUT/gpu_diag_aoti_$STEM.json"
step aoti_after_persist 170 env COMPILEDUMP_NATIVE=0 "$PY" scripts/gpu_check.py --device cuda \
    --only eager persist aoti --out "$OUT/gpu_diag_aoti_after_persist_$STEM.json"
echo "== done in ${SECONDS} s"
