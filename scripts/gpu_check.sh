#!/usr/bin/env bash
# The GPU machine's one call: GPU tests, the CPU suite on that machine's torch (the
# compatibility check), then the benchmark. Results land in ${OUT:-gpu_out}/.
#   bash scripts/gpu_check.sh [bench args...]
# Env: SKIP_CPU_SUITE=1, SKIP_GPU_TESTS=1, SKIP_BENCH=1. Test packages missing on the
# machine are installed from wheels in .whl/ when the call carries them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d .whl ]; then
  for pair in pytest:pytest pluggy:pluggy iniconfig:iniconfig hypothesis:hypothesis \
              sortedcontainers:sortedcontainers expecttest:expecttest tqdm:tqdm; do
    mod=${pair%%:*}; whl=${pair##*:}
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
      --target /tmp/site .whl/${whl}-*.whl
  done
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
fi
if [ "${SKIP_CPU_SUITE:-0}" != 1 ]; then
  python3 -m pytest -q -m "not gpu" -p no:cacheprovider 2>&1 | tee "$OUT/cpu_suite_on_gpu_box.txt" | tail -4
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m moeblaze_ops.bench --out "$OUT" "$@" 2>"$OUT/bench_stderr.txt" | tee "$OUT/bench_stdout.txt"
  tail -3 "$OUT/bench_stderr.txt"
fi
