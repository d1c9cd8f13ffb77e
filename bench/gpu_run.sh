#!/usr/bin/env bash
# One batched session on a lent GPU machine (no network there): install the carried wheels
# (.whl/: pydantic and friends, sdnotify), run the GPU tests, then the GPU benchmark.
#   bash bench/gpu_run.sh [SIZE_GB] [EXTRA_SIZE_GB]        (carry .whl; SKIP_TESTS=1 skips the tests)
# SIZE_GB (default 2) is the full side-by-side run; EXTRA_SIZE_GB, when given, repeats only the
# H2D and wcd fill measurements on a second checkpoint with more fill configurations.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/wcd-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import sys, torch, numpy, safetensors, cuda.bindings as cb; print(sys.version.split()[0], 'torch', \
torch.__version__, 'numpy', numpy.__version__, 'safetensors', safetensors.__version__, 'cuda.bindings', cb.__version__)"
nvidia-smi -L; nproc; free -g | head -2; df -h /tmp | tail -1

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python3 -m pytest tests/gpu -v -s -rA -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" \
    | grep -E "PASSED|FAILED|ERROR|SKIPPED|gpu-info|passed|failed|Error|assert" | cut -c1-400
fi
timeout 500 python3 bench/bench_gpu.py --dir /tmp/wcd-bench-${1:-2} --size-gb "${1:-2}" --out "$OUT/bench.json" \
  2>&1 | tee "$OUT/bench.log" | grep -v "^\[bench\]"
if [ -n "${2:-}" ]; then
  timeout 150 python3 bench/bench_gpu.py --dir /tmp/wcd-bench-$2 --size-gb "$2" --parts h2d,wcd \
    --fill default,16x4,8x8,8x16 --out "$OUT/bench-$2.json" 2>&1 | tee "$OUT/bench-$2.log" | grep -v "^\[bench\]"
fi
