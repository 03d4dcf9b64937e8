#!/usr/bin/env bash
# The whole GPU run as one command, under 8 minutes on one GPU, with no package index:
#
#   bash scripts/gpu_run.sh                     # writes into $OUT (default: benchmarks/gpu/)
#
# 1. prints the versions (python, torch, CUDA, triton, GPU, nvcc, cmake);
# 2. starts building the native library in the background (CMakeLists.txt, in a temporary
#    directory, `nice`d, under its own timeout) if cmake and nvcc are here and nvcc's CUDA major
#    is torch's; it installs into compiledump/, which the steps below do not load
#    (COMPILEDUMP_NATIVE=0) until step 4;
# 3. python scripts/gpu_check.py --device cuda, then python benchmarks/gpu_bench.py --device cuda,
#    on the Python/Triton path, each under `timeout` and with --time-limit a little below it (each
#    script skips the phases that would not fit, and rewrites its JSON after every phase, so a
#    kill keeps what it had);
# 4. last (never-run native code cannot spoil the measurements), in the GPU_RUN_RESERVE_S kept
#    for it: waits for the build, then runs the native path (COMPILEDUMP_NATIVE=1 and
#    COMPILEDUMP_CUDA_KERNEL=native: the region table and the CUDA kernel serve `capture_v1`,
#    checked first), each in its own process: gpu_check.py's eager, cuda_graph, native_cuda_kernel
#    (its CUDA kernel against the Triton kernel) and persist (the host-mapped arena's system-scope
#    commit) phases; its reduce_overhead and compiled_default (what making the native kernel the
#    CUDA default waits for); its aoti (a package whose captures call the library's C shims; step
#    3 leaves aoti out: through the proxy executor its CUDA package killed the process on torch
#    2.11); then gpu_bench.py's graph_capture_cost, compiled_host_cost and decode_overhead (issue
#    14's device and host cost per capture, and the 40 layers x 5 taps step overhead, against the
#    same phases of step 3), with what time is left (each phase is skipped rather than cut when
#    its estimate does not fit; at the default budget the last ones may not).
# Files, named with the UTC date and the torch and triton versions: $OUT/gpu_check_<date>_torch<v>_
# triton<v>.json, $OUT/gpu_bench_<...>.json, $OUT/gpu_native_<...>.json (gpu_check on the native
# path), $OUT/gpu_native_bench_<...>.json, $OUT/gpu_native_aoti_<...>.json,
# $OUT/gpu_native_compiled_<...>.json, $OUT/gpu_run_<...>.log.
# Without a usable CUDA device it prints both scripts' plans (--dry-run) and exits 0.
# Settings (environment): OUT; GPU_RUN_BUDGET (seconds for everything, default 450);
# GPU_RUN_NATIVE_LIB (a native library built elsewhere for this torch and GPU, copied into
# compiledump/ instead of building one: the native phases need not wait for a build);
# GPU_RUN_RESERVE_S (kept for the native path's phases, default 200; 0 when it cannot be built); GPU_RUN_BUILD_S (the
# build's limit, default 240, counted from the start); GPU_RUN_DEVICE (default cuda; cpu runs both
# scripts on the CPU, gpu_bench with --quick); PYTHON (default python3, else python).
# Exit status: 0 when both scripts ran and no phase failed, 1 otherwise (0 without CUDA).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO=$PWD
BUDGET=${GPU_RUN_BUDGET:-450}
BUILD_S=${GPU_RUN_BUILD_S:-240}  # the background build's limit
RESERVE_S=${GPU_RUN_RESERVE_S:-200}  # kept for the native path's phases, at the end
DEVICE=${GPU_RUN_DEVICE:-cuda}
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-$REPO/benchmarks/gpu}
mkdir -p "$OUT" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's compiledump, installed or not

versions=$("$PY" -c 'import torch, triton; print(torch.__version__.replace("+", "-"), triton.__version__)' 2>/dev/null)
read -r TORCH_V TRITON_V <<<"${versions:-unknown unknown}"
STEM="$(date -u +%F)_torch${TORCH_V}_triton${TRITON_V}"
LOG="$OUT/gpu_run_$STEM.log"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
BUILD_PID=""
finish() {  # the log is complete when we exit; a build still running is stopped
    [ -n "$BUILD_PID" ] && kill "$BUILD_PID" 2>/dev/null
    exec 1>&- 2>&-
    wait "$TEE_PID" 2>/dev/null
}
trap finish EXIT
echo "== gpu_run $(date -u +%FT%TZ) in $REPO; output: $OUT; budget ${BUDGET} s"

echo "== versions"
"$PY" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}; torch {torch.__version__} (CUDA {torch.version.cuda})")
try:
    import triton
    print(f"triton {triton.__version__}")
except Exception as error:
    print(f"triton: not importable ({error})")
try:
    import compiledump
    print(f"compiledump {compiledump.__version__} from {compiledump.__file__}")
except Exception as error:
    print(f"compiledump: not importable ({error})")
available = torch.cuda.is_available()
print(f"CUDA available: {available}; devices: {torch.cuda.device_count() if available else 0}")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
command -v git >/dev/null && git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /'
NVCC=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
[ -n "$NVCC" ] && "$NVCC" --version | tail -n 2
command -v cmake >/dev/null && cmake --version | head -n 1
# The crash-proof CUDA arena needs tmpfs on Linux 6.5+ (docs/crashes.md): the kernel and filesystems.
echo "kernel $(uname -r); /tmp on $(stat -f -c %T /tmp 2>/dev/null); /dev/shm on $(stat -f -c %T /dev/shm 2>/dev/null)"

if [ "$DEVICE" != cpu ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "== no usable CUDA device here (torch $TORCH_V): the GPU phases cannot run; the plans:"
    "$PY" scripts/gpu_check.py --device "$DEVICE" --dry-run --out "$OUT/gpu_check_$STEM.json"
    "$PY" benchmarks/gpu_bench.py --device "$DEVICE" --dry-run --out "$OUT/gpu_bench_$STEM.json"
    echo "== done: nothing measured (no CUDA); log: $LOG"
    exit 0
fi

# The native library builds in the background while the Python/Triton path is measured
# (gpu_check gets half of what is left, gpu_bench what it leaves minus RESERVE_S for the native
# path's phases at the end: a fault in never-run native code cannot spoil the measurements).
export COMPILEDUMP_SIGNALS=0  # a timeout's SIGTERM ends the script at once (no flush of a scratch dump)
export PYTHONUNBUFFERED=1     # the log keeps the order of what the scripts print
export COMPILEDUMP_NATIVE=0   # not built yet; the last step checks it
QUICK=""
[ "$DEVICE" = cpu ] && QUICK="--quick"
status=0
run_script() {  # name script share-of-what-is-left-in-% [extra args...]
    local name=$1 script=$2 share=$3
    shift 3
    local limit=$(( (BUDGET - RESERVE_S - SECONDS - 5) * share / 100 ))
    if [ "$limit" -lt 40 ]; then
        echo "== $name: skipped (only ${limit} s of the budget left)"
        status=1
        return
    fi
    echo "== $name (timeout ${limit} s)"
    # --time-limit counts from the script's start (imports and CUDA init included).
    timeout -k 10 "$limit" "$PY" "$script" --device "$DEVICE" --time-limit $((limit - 20)) \
        --out "$OUT/${name}_$STEM.json" "$@"
    local rc=$?
    case $rc in
        0) ;;
        124|137) echo "== $name: killed by the timeout (${limit} s); its JSON holds the phases it finished"; status=1 ;;
        *) echo "== $name: exit $rc"; status=1 ;;
    esac
}
NATIVE="skipped"
BUILD_LOG=$(mktemp "${TMPDIR:-/tmp}/compiledump-build-log.XXXXXX")
if [ "$DEVICE" = cpu ]; then
    NATIVE="skipped (GPU_RUN_DEVICE=cpu)"
elif [ -n "${GPU_RUN_NATIVE_LIB:-}" ]; then
    # Built elsewhere for this torch and GPU (the checks below still refuse a mismatch): the
    # native phases then start as soon as the Triton path's are done.
    if cp "$GPU_RUN_NATIVE_LIB" compiledump/libcompiledump_native.so; then
        NATIVE="built elsewhere, copied from $GPU_RUN_NATIVE_LIB"
    else
        NATIVE="skipped (cannot copy GPU_RUN_NATIVE_LIB=$GPU_RUN_NATIVE_LIB)"
    fi
elif ! command -v cmake >/dev/null; then
    NATIVE="skipped (no cmake)"
elif [ -z "$NVCC" ]; then
    NATIVE="skipped (no nvcc)"
elif [ "$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')" != \
       "$("$PY" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')" ]; then
    # A library built by another CUDA major than torch's would not load, or fail at launch.
    NATIVE="skipped (nvcc's CUDA major differs from torch's CUDA $("$PY" -c 'import torch; print(torch.version.cuda)'))"
else
    BUILD_DIR=$(mktemp -d "${TMPDIR:-/tmp}/compiledump-build.XXXXXX")
    PREFIX=$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
    ARCH=$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}.{n}")')
    JOBS=$(( $(nproc) > 2 ? $(nproc) / 2 : 1 ))  # half the cores: the measurements run meanwhile
    echo "== native library: building in the background (limit ${BUILD_S} s, -j $JOBS, sm_${ARCH/./}); log below at the end"
    # TORCH_CUDA_ARCH_LIST: torch's CMake config then does not probe the GPU; no C++ driver (unused here).
    PATH="$(dirname "$NVCC"):$PATH" CUDACXX=$NVCC TORCH_CUDA_ARCH_LIST=$ARCH timeout -k 5 "$BUILD_S" nice -n 10 bash -c '
        cmake -S . -B "$1" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$2" -DCMAKE_CUDA_COMPILER="$3" \
              -DCMAKE_CUDA_ARCHITECTURES="${4/./}" -DCOMPILEDUMP_BUILD_DRIVER=OFF \
        && cmake --build "$1" -j "$5" && cmake --install "$1"' _ "$BUILD_DIR" "$PREFIX" "$NVCC" "$ARCH" "$JOBS" \
        >"$BUILD_LOG" 2>&1 &
    BUILD_PID=$!
    BUILD_STARTED=$SECONDS
fi

# Nothing to keep time for when the native path cannot run: the two scripts share it.
[ "${NATIVE#skipped}" != "$NATIVE" ] && RESERVE_S=0
# aoti runs on the native path only (its package calls the C shims): through the proxy executor
# its CUDA package killed the process on torch 2.11 (docs/export.md; scripts/gpu_diagnose.sh
# checks that again).
run_script gpu_check scripts/gpu_check.py 50 --only eager triton_launch cuda_graph native_cuda_kernel compiled_default \
    reduce_overhead persist
run_script gpu_bench benchmarks/gpu_bench.py 100 $QUICK

if [ -n "$BUILD_PID" ]; then
    wait "$BUILD_PID"
    rc=$?
    BUILD_PID=""
    echo "== native library build (exit $rc, $((SECONDS - BUILD_STARTED)) s after it started):"
    tail -n 15 "$BUILD_LOG"
    if [ "$rc" -eq 0 ]; then
        NATIVE="built and installed (sm_${ARCH/./})"
    else
        [ "$rc" -eq 124 ] && why="timed out after ${BUILD_S} s" || why="failed (exit $rc)"
        NATIVE="build $why; the native path was not checked"
        status=1
    fi
    rm -rf "$BUILD_DIR"
fi
rm -f "$BUILD_LOG"
native_script() {  # name script limit args...: one script on the native path
    local name=$1 script=$2 limit=$3
    shift 3
    if [ "$limit" -lt 30 ]; then
        echo "== $name: skipped (only ${limit} s of the budget left)"
        status=1
        return
    fi
    echo "== $name on the native path (timeout ${limit} s)"
    COMPILEDUMP_NATIVE=1 COMPILEDUMP_CUDA_KERNEL=native timeout -k 10 "$limit" "$PY" "$script" --device "$DEVICE" --time-limit $((limit - 15)) \
        --out "$OUT/${name}_$STEM.json" "$@" || status=1
}
if [ "${NATIVE#built}" != "$NATIVE" ]; then
    # Loaded, and serving capture_v1 on CUDA: a library CMake built without CUDA (torch's CUDA
    # libraries not found) loads too, and would leave every CUDA capture to Triton.
    owner=$(COMPILEDUMP_NATIVE=1 COMPILEDUMP_CUDA_KERNEL=native "$PY" -c 'import compiledump
from compiledump.ops import register
print(("native" if register.native_owns_capture("cuda") else "python")
      if compiledump.native_available() else "not loaded")' 2>&1 | tail -n 1)
    if [ "$owner" = native ]; then
        # Each in its own process, the open questions first (a crash, as aoti's, loses only itself):
        # what making the native kernel the CUDA default waits for (compiled code), then aoti
        # through the C shims, then the benchmark the first run already took (2026-12-04).
        left_at_most() {  # seconds of the budget left (10 kept for the end), at most $1
            local left=$(( BUDGET - SECONDS - 10 ))
            echo $(( left < $1 ? left : $1 ))
        }
        native_script gpu_native scripts/gpu_check.py $(( $(left_at_most 150) * 40 / 100 )) \
            --only eager cuda_graph native_cuda_kernel persist
        native_script gpu_native_compiled scripts/gpu_check.py "$(left_at_most 120)" \
            --only eager reduce_overhead compiled_default
        native_script gpu_native_aoti scripts/gpu_check.py "$(left_at_most 120)" --only eager aoti
        native_script gpu_native_bench benchmarks/gpu_bench.py "$(left_at_most "$BUDGET")" \
            --only graph_capture_cost compiled_host_cost decode_overhead
    else
        NATIVE="$NATIVE; but capture_v1 on CUDA is served by: $owner (not the library)"
        status=1
    fi
fi
echo "native: $NATIVE"
echo "== done in ${SECONDS} s; native: $NATIVE"
ls -l "$OUT"/*"$STEM"* 2>/dev/null
exit $status
