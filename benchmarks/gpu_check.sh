#!/usr/bin/env bash
# One GPU lease's checks in one command, each stage under its own time cap, every log under
# $OUT (default ./gpu-out): the imports, `make test-gpu`'s tests (the GPU-only engine tests
# beside the Triton kernels' tests compiled) and benchmarks/gpu_features.py together, then benchmarks/gpu_throughput.py on the 1B shape.
# Tried on the CPU first with `GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh` (tiny, CPU).
#
#   bash benchmarks/gpu_check.sh            # about 9 minutes on one H200
#
# Wheels for packages the machine lacks (no registry there) are installed from .whl/ when it
# exists (see the device notes; xgrammar for the grammar masks' warm-up, redis and
# OpenTelemetry for the engine server).
set -u
OUT=${OUT:-$PWD/gpu-out}
PY=${PY:-python3}
TESTS_S=${TESTS_S:-200}
BENCH_S=${BENCH_S:-300}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pagoda-site .whl/*.whl >"$OUT/wheels.log" 2>&1 && export PYTHONPATH=$PWD:/tmp/pagoda-site
fi
stage() { echo "== $(date -u +%T) $*"; }

stage env
{ nvidia-smi -L 2>&1; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" -c "import torch, triton, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.is_available())"
  "$PY" -c "import xgrammar, msgpack, aiohttp, safetensors, redis, opentelemetry.sdk; print('imports ok')"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# A later call on the same lease can narrow each stage: KERNEL_TESTS, ENGINE_TESTS (empty:
# none), FEATURES (gpu_features.py's --checks), BENCH_PARTS (gpu_throughput.py's --parts).
KERNEL_TESTS=${KERNEL_TESTS:-"tests/engine/test_triton_kernels.py tests/engine/test_triton_fused_kernels.py
  tests/engine/test_triton_moe.py tests/engine/test_triton_lora.py tests/engine/test_w4a16_triton.py
  tests/engine/test_w8a8_triton.py"}
ENGINE_TESTS=${ENGINE_TESTS-tests/engine/test_gpu.py}
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then  # the CPU rehearsal: the same commands, small and interpreted
  export TRITON_INTERPRET=1
  KERNEL_TESTS="tests/engine/test_w8a8_triton.py"
  BENCH_ARGS="--device cpu --tiny"
  BENCH_PARTS=${BENCH_PARTS:-offline,batch1,server}
  FEATURE_ARGS="--device cpu"
else
  BENCH_ARGS="--model-dir /tmp/pagoda-1b"  # kept for a second call on the same machine
  FEATURE_ARGS=""
fi

XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n 6"  # compiles in parallel where pytest-xdist is
stage "tests (cap ${TESTS_S}s): the engine on the GPU beside the kernels compiled"
engine_tests=""
if [ -n "$ENGINE_TESTS" ]; then
  # shellcheck disable=SC2086
  timeout -k 10 "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -rfE --durations=15 \
    $ENGINE_TESTS >"$OUT/test_gpu.log" 2>&1 &
  engine_tests=$!
fi
# shellcheck disable=SC2086
timeout -k 10 "$TESTS_S" "$PY" benchmarks/gpu_features.py --json "$OUT/features.json" \
  ${FEATURES:+--checks "$FEATURES"} $FEATURE_ARGS \
  >"$OUT/features.log" 2>&1 &
features=$!
# shellcheck disable=SC2086
timeout -k 10 "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -rfE $XDIST $KERNEL_TESTS \
  >"$OUT/test_kernels.log" 2>&1
echo "kernel tests exit $?"; tail -5 "$OUT/test_kernels.log"
if [ -n "$engine_tests" ]; then
  wait "$engine_tests"
  echo "engine tests exit $?"; tail -8 "$OUT/test_gpu.log"
fi
wait $features
echo "features exit $?"; grep -E "^(PASS|FAIL)|passed" "$OUT/features.log"

stage "benchmarks/gpu_throughput.py (budget $((BENCH_S - 20))s)"
# shellcheck disable=SC2086
timeout -k 10 "$BENCH_S" "$PY" benchmarks/gpu_throughput.py --json "$OUT/gpu.json" \
  --budget-s $((BENCH_S - 20)) ${BENCH_PARTS:+--parts "$BENCH_PARTS"} $BENCH_ARGS 2>&1 | tee "$OUT/gpu_throughput.log" | grep -v "^Loading\|it/s\]"
stage done
