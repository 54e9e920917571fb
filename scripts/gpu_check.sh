#!/usr/bin/env bash
# The GPU machine's one call (about 8 minutes): run-to-run equality of every gradient over
# seeds, the GPU tests (kernels, Gluon kernels, Inductor lowerings), the host time of a
# small layer (scripts/host_overhead.py), then the benchmark,
# forward and train modes, moeblaze eager and compiled beside the peers. Results land in
# ${OUT:-gpu_out}/: log.txt (everything printed), forward/ and train/ (bench.md, bench.json).
#   bash scripts/gpu_check.sh [extra bench args...]
# Env: SKIP_DETERMINISM=1, SKIP_GPU_TESTS=1, SKIP_HOST=1, SKIP_BENCH=1, SKIP_TRAIN=1 leave parts out;
# GPU_TESTS_K=<pytest -k expr> picks GPU tests; CPU_SUITE=1 adds the CPU suite on that
# machine's torch (a compatibility check, 3 more minutes); PROFILE=1 adds
# scripts/profile_step.py (kernel and host time per step) into $OUT/profile.txt;
# GPU_TEST_WORKERS=<n> sets the pytest-xdist processes (6; one GPU is shared); GPU_TESTS_TIMEOUT=<s>
# ends the GPU tests after that many seconds (420);
# HOST_ROUNDS=1 times the 100M example's layer eager, compiled (weights as arguments, and in a
# closure as the benchmark's peers) and under CUDA graphs, alternating (scripts/host_overhead.py --rounds);
# DISPATCH_PROFILE=1 adds dispatch's device time kernel by kernel at the benchmark's dispatch
# sizes, beside sort + histc + cumsum (scripts/profile_dispatch.py);
# EXAMPLE=1 adds the 100M example (eager, compiled, reduce-overhead; moeblaze and grouped_mm);
# EXAMPLE_AB=1 times the example's model with the two backends alternating in one process
# (scripts/profile_model.py --rounds: medians over rounds, eager and compiled);
# GLUON_WS=1 times the warp-specialised Gluon kernels (scripts/compare_row_gemm.py,
# scripts/tune_backward.py) and trains with every Gluon kernel warp-specialised;
# BACKWARD_TEMPLATES=1 adds a compiled train run with settings.backward_templates=() (the op's
# kernels for grad_x too, the other side of the default);
# SWITCHES=1 measures the other side of each tuning switch (log only); EP=1 adds the
# expert-parallel GPU tests and benchmark (2 GPUs: kind nvidia-h200-x2) into $OUT/ep/. Test
# packages missing on the machine are installed from wheels in .whl/ when the call carries them.
# WGRAD=1 sweeps the Gluon weight gradients (row-ordered operand by TMA or not, TMA-store
# epilogue or not, next tile started first or not) and,
# where Nsight Compute reads the counters, writes each kernel's stall reasons to $OUT/ncu.txt.
# DH=1 times dH on the tl kernel and the Gluon one (scripts/tune_backward.py --dh-gluon, the Gluon
# one with fewer chunks of h in flight too) and, where ncu reads the counters, sums the Gluon
# kernel's warp-stall samples by region (scripts/stall_regions.py) at Mixtral- and OLMoE-like.
# GATED_EPILOGUE=1 runs the up projection's activation-in-the-epilogue tests, times it
# against the GEMM and the activation pass (scripts/compare_row_gemm.py --kinds up_act), and
# the layer's forward with settings.up_epilogue_activation off and on (eager and compiled).
# PEER_SITE=<dir> passes --peer-site <dir> to the benchmark (a peer such as SonicMoE installed
# there with pip --target: its rows join the tables).
# SONICMOE=1, in the call right after `bash scripts/sonicmoe_peer.sh stash` and carrying
# .peer-sonicmoe-2: installs SonicMoE and runs the train benchmark at OLMoE- and
# Mixtral-like beside it (moeblaze eager and compiled, compiled grouped_mm) into
# $OUT/train_sonicmoe/, then profiles both steps kernel by kernel (scripts/profile_step.py);
# its JIT takes minutes a shape, so leave the call to it.
# BESIDE_H=1 runs the GPU tests of act(h) beside h (settings.activation_beside_h_max_columns:
# both from the up GEMM's epilogue), times that kernel against the GEMM and the activation
# pass, and the training step with the defaults against the setting off, interleaved in one
# process (scripts/ab_step.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# A source checkout on PYTHONPATH (no install): the package's lowerings are the repo's
# top-level lowerings/, which an install maps to moeblaze_ops.lowerings.
[ -e moeblaze_ops/lowerings ] || ln -s ../lowerings moeblaze_ops/lowerings
if [ -d .whl ]; then
  # module:wheel-name pairs; xdist runs the GPU tests in several processes (most of their
  # time is Triton compiling, which is CPU work).
  for pair in pytest:pytest pluggy:pluggy iniconfig:iniconfig hypothesis:hypothesis \
      sortedcontainers:sortedcontainers expecttest:expecttest tqdm:tqdm execnet:execnet xdist:pytest_xdist; do
    mod=${pair%%:*} whl=${pair##*:}
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
      --target /tmp/site .whl/${whl}-*.whl
  done
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$LOG"
if [ "${SKIP_DETERMINISM:-0}" != 1 ]; then
  echo "== two runs of every gradient, 8 seeds, skewed routing" | tee -a "$LOG"
  python3 scripts/repeat_backward_check.py --seeds 8 2>&1 | grep -v Warning | tee -a "$LOG"
fi
if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
  echo "== GPU tests" | tee -a "$LOG"
  workers=()
  PYTHONPATH=$PYTHONPATH python3 -c "import xdist" 2>/dev/null && workers=(-n "${GPU_TEST_WORKERS:-6}")
  # A kernel that hangs ends the tests, not the whole call.
  timeout "${GPU_TESTS_TIMEOUT:-420}" python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_gluon_row_gemm.py tests/test_gpu_gluon_dh.py tests/test_lowerings.py -p no:cacheprovider -rf --tb=short --durations=8 "${workers[@]}" \
    ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} 2>&1 | tee -a "$LOG" | tail -15
fi
if [ "${CPU_SUITE:-0}" = 1 ]; then
  echo "== CPU suite on this machine's torch" | tee -a "$LOG"
  python3 -m pytest -q -m "not gpu" -p no:cacheprovider 2>&1 | tee -a "$LOG" | tail -4
fi
if [ "${SKIP_HOST:-0}" != 1 ]; then
  echo "== host time of the 100M example's layer (wall, then moeblaze's Python alone)" | tee -a "$LOG"
  for flag in "" --no-kernels; do
    python3 scripts/host_overhead.py --config qwen3_100m --rows 0 $flag 2>>"$LOG" | head -1 | tee -a "$LOG"
  done
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench forward" | tee -a "$LOG"
  python3 -m moeblaze_ops.bench --out "$OUT/forward" --skip hf_eager \
    --configs olmoe qwen3_a3b conf3 conf4 mixtral deepseek_v3 ${PEER_SITE:+--peer-site "$PEER_SITE"} "$@" \
    2>>"$LOG" | tee -a "$LOG"
fi
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  echo "== bench train" | tee -a "$LOG"
  python3 -m moeblaze_ops.bench --mode train --no-dispatch --out "$OUT/train" --skip hf_eager moeblaze_recompute_compiled \
    --configs qwen3_100m olmoe qwen3_a3b conf3 conf4 mixtral deepseek_v3 ${PEER_SITE:+--peer-site "$PEER_SITE"} "$@" \
    2>>"$LOG" | tee -a "$LOG"
fi
if [ "${SONICMOE:-0}" = 1 ]; then
  echo "== bench train beside SonicMoE" | tee -a "$LOG"
  bash scripts/sonicmoe_peer.sh install 2>&1 | tail -1 | tee -a "$LOG"
  python3 -m moeblaze_ops.bench --mode train --no-dispatch --out "$OUT/train_sonicmoe" --peer-site /tmp/peer-site \
    --skip hf_eager hf_grouped_mm moeblaze_recompute moeblaze_recompute_compiled --configs olmoe mixtral \
    2>>"$LOG" | tee -a "$LOG"
  echo "== the step kernel by kernel, SonicMoE beside moeblaze" | tee -a "$LOG"
  timeout 240 python3 scripts/profile_step.py --peer-site /tmp/peer-site --configs olmoe mixtral \
    --peers sonicmoe moeblaze --steps 3 --rows 24 2>>"$LOG" | tee -a "$LOG"
fi
if [ "${HOST_ROUNDS:-0}" = 1 ]; then
  echo "== the 100M example's layer by harness, alternating rounds" | tee -a "$LOG"
  python3 scripts/host_overhead.py --config qwen3_100m --rounds 5 --steps 200 2>>"$LOG" | grep median | tee -a "$LOG"
fi
if [ "${DISPATCH_PROFILE:-0}" = 1 ]; then
  echo "== dispatch, kernel by kernel" | tee -a "$LOG"
  python3 scripts/profile_dispatch.py 2>>"$LOG" | tee -a "$LOG"
fi
if [ "${EXAMPLE:-0}" = 1 ]; then
  # The 100M example (8 MoE layers), moeblaze against grouped_mm: eager, compiled, and
  # compiled with CUDA graphs.
  for mode in "" "--compile" "--compile reduce-overhead"; do
    echo "== 100M example ${mode:-eager}" | tee -a "$LOG"
    python3 examples/finetune_hf_moe.py --size 100m --device cuda --dtype bfloat16 --steps 40 --warmup 10 $mode \
      --experts-implementation moeblaze grouped_mm 2>>"$LOG" | grep -E "parameters|tokens/s" | tee -a "$LOG"
  done
fi
if [ "${EXAMPLE_AB:-0}" = 1 ]; then
  for mode in "" "--compile"; do
    echo "== 100M example's model, backends alternating, ${mode:-eager}" | tee -a "$LOG"
    python3 scripts/profile_model.py --rounds 6 --round-steps 20 $mode 2>>"$LOG" | tee -a "$LOG"
  done
fi
if [ "${BACKWARD_TEMPLATES:-0}" = 1 ]; then
  # The compiled backward with grad_x from the op's kernels, against the same run's
  # moeblaze_compiled rows above (grad_x as templates, settings.backward_templates' default).
  echo "== train, compiled, backward_templates=()" | tee -a "$LOG"
  python3 -m moeblaze_ops.bench --mode train --no-dispatch --out "$OUT/train_dx_template" \
    --skip hf_eager hf_grouped_mm moeblaze moeblaze_recompute moeblaze_recompute_compiled sonicmoe \
    --set "backward_templates=()" --configs qwen3_100m olmoe mixtral 2>>"$LOG" | tee -a "$LOG"
fi
if [ "${GLUON_WS:-0}" = 1 ]; then
  # The warp-specialised Gluon kernels: kernel by kernel against the other Gluon kernels
  # and tl, then the layer with every GEMM on them (the defaults' rows are above).
  echo "== row GEMMs: gluon_ws, gluon, tl" | tee -a "$LOG"
  python3 scripts/compare_row_gemm.py --configs olmoe mixtral 2>>"$LOG" | tee -a "$LOG"
  echo "== weight gradients: gluon warp-specialised or not, tl" | tee -a "$LOG"
  python3 scripts/tune_backward.py --configs olmoe mixtral --kinds wgrad_down wgrad_up --tiles 256,128,64,8,4 \
    2>>"$LOG" | tee -a "$LOG"
  echo "== train, every Gluon kernel warp-specialised" | tee -a "$LOG"
  python3 -m moeblaze_ops.bench --mode train --no-dispatch --out "$OUT/train_gluon_ws" \
    --skip hf_eager hf_grouped_mm moeblaze_compiled moeblaze_recompute moeblaze_recompute_compiled sonicmoe \
    --set "gluon={'wgrad_down','wgrad_up','up','down','dx'}" \
    --set "gluon_warp_specialize={'wgrad_down','wgrad_up','up','down','dx'}" --configs olmoe mixtral \
    2>>"$LOG" | tee -a "$LOG"
fi
if [ "${GATED_EPILOGUE:-0}" = 1 ]; then
  echo "== the up GEMM with SwiGLU in its epilogue: tests, then against the GEMM and the activation pass" | tee -a "$LOG"
  python3 -m pytest -q -m gpu tests/test_gpu_gluon_row_gemm.py -k gated_epilogue -p no:cacheprovider 2>&1 \
    | tail -3 | tee -a "$LOG"
  python3 scripts/compare_row_gemm.py --kinds up_act --configs olmoe qwen3_a3b conf4 mixtral deepseek_v3 \
    2>>"$LOG" | tee -a "$LOG"
  for fused in False True; do
    echo "== forward, up_epilogue_activation=$fused" | tee -a "$LOG"
    python3 -m moeblaze_ops.bench --no-dispatch --out "$OUT/forward_up_epilogue_$fused" \
      --skip hf_eager hf_grouped_mm hf_grouped_mm_compiled moeblaze_recompute moeblaze_recompute_compiled sonicmoe \
      --configs olmoe mixtral conf4 --set up_epilogue_activation=$fused 2>>"$LOG" | grep -E '^\|' | tee -a "$LOG"
  done
fi
if [ "${BESIDE_H:-0}" = 1 ]; then
  echo "== h beside act(h): tests, the kernel, the step" | tee -a "$LOG"
  timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_gluon_row_gemm.py -p no:cacheprovider \
    -k "activation_beside_h or gated_epilogue" 2>&1 | tail -3 | tee -a "$LOG"
  python3 scripts/compare_row_gemm.py --kinds up_act --configs olmoe qwen3_a3b conf4 mixtral \
    2>>"$LOG" | tee -a "$LOG"
  python3 scripts/ab_step.py --configs olmoe qwen3_a3b conf4 mixtral deepseek_v3 --rounds 5 --variant "" \
    --variant "activation_beside_h_max_columns=None" 2>>"$LOG" | tee -a "$LOG"
fi
if [ "${WGRAD:-0}" = 1 ]; then
  echo "== weight gradients: row-ordered operand by cp.async (128x256 tiles) or TMA (256x128); tiles stored" \
    "from registers or by TMA; the next tile started before or after a tile's store" | tee -a "$LOG"
  for pair in "128,256,64,8,4:0" "256,128,64,8,4:1"; do
    python3 scripts/tune_backward.py --configs olmoe mixtral deepseek_v3 --kinds wgrad_down wgrad_up \
      --tiles "${pair%%:*}" --ws 0 --gluon 1 --rows-tma "${pair##*:}" --tma-store 0 1 \
      --wgrad-band 1 2>>"$LOG" | tee -a "$LOG"
  done
  if command -v ncu >/dev/null; then
    echo "== stall reasons of the weight gradients (ncu, Mixtral-like dW_up)" | tee -a "$LOG"
    for pair in "128,256,64,8,4:0" "256,128,64,8,4:1"; do
      timeout 240 ncu --clock-control none --kernel-name regex:_wgrad --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        python3 scripts/tune_backward.py --configs mixtral --kinds wgrad_up --tiles "${pair%%:*}" --ws 0 --gluon 1 \
        --rows-tma "${pair##*:}" >> "$OUT/ncu.txt" 2>&1
    done
    grep -E "_wgrad|Duration|Throughput|stalled_.*ratio" "$OUT/ncu.txt" | awk '$NF+0 > 0.05 || !/stalled/' | tee -a "$LOG"
  fi
fi
if [ "${DH:-0}" = 1 ]; then
  echo "== dH: the Gluon kernel (its chunks of h in flight: as many as fit, 2) against the tl kernel" | tee -a "$LOG"
  timeout 300 python3 scripts/tune_backward.py --configs olmoe mixtral deepseek_v3 --kinds dh --dh-fast 1 --dh-gluon 1 0 \
    --dh-slots None 2 --w-tma 1 --tiles 128,256,64,8,4 128,256,64,8,3 2>>"$LOG" | grep -v failed | tee -a "$LOG"
  if command -v ncu >/dev/null; then
    echo "== where the Gluon dH's warps wait (ncu samples by SASS line, summed by region: scripts/stall_regions.py)" | tee -a "$LOG"
    for config in mixtral olmoe; do
      timeout 240 ncu --clock-control none --kernel-name regex:_dh_kernel --launch-skip 3 --launch-count 1 \
        --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source no \
        --export "/tmp/dh_$config" -f python3 scripts/tune_backward.py --configs $config --kinds dh --dh-fast 1 \
        --dh-gluon 1 --w-tma 1 --tiles 128,256,64,8,4 >> "$OUT/ncu.txt" 2>&1
      ncu -i "/tmp/dh_$config.ncu-rep" --page source --csv --print-source sass > "/tmp/dh_$config.csv" 2>>"$LOG"
      python3 scripts/stall_regions.py --opcodes "/tmp/dh_$config.csv" 2>>"$LOG" | tee -a "$LOG"
    done
  fi
fi
if [ "${SWITCHES:-0}" = 1 ]; then
  # The other side of each tuning switch (docs/perf-notes.md), to compare with the
  # defaults measured above; tables go to the log only.
  echo "== switches: memory at the peak (conf3)" | tee -a "$LOG"
  python3 scripts/memory_peak.py --config conf3 2>>"$LOG" | tee -a "$LOG"
  echo "== switches: dh_fast_activation" | tee -a "$LOG"
  python3 scripts/tune_backward.py --kinds dh --dh-fast 0 1 --w-tma 1 --tiles 128,128,64,8,4 2>>"$LOG" | tee -a "$LOG"
  echo "== switches: dispatch without sorted chunks, with sorted chunks of 1024" | tee -a "$LOG"
  for setting in dispatch_sorted_min_bins=None dispatch_sort_chunk=1024; do
    python3 -m moeblaze_ops.bench --configs --set "$setting" --out /tmp/switch_dispatch 2>>"$LOG" | tee -a "$LOG"
  done
  echo "== switches: column_slab=None, no slabs (forward, train)" | tee -a "$LOG"
  python3 -m moeblaze_ops.bench --set column_slab=None --no-dispatch --configs olmoe conf3 conf4 mixtral \
    --skip hf_eager hf_grouped_mm moeblaze_compiled --out /tmp/switch_dslab_fwd 2>>"$LOG" | tee -a "$LOG"
  python3 -m moeblaze_ops.bench --set column_slab=None --mode train --no-dispatch --configs olmoe conf3 conf4 mixtral \
    --skip hf_eager hf_grouped_mm moeblaze_compiled moeblaze_recompute_compiled --out /tmp/switch_dslab_train \
    2>>"$LOG" | tee -a "$LOG"
fi
if [ "${EP:-0}" = 1 ]; then
  echo "== expert parallelism on 2 GPUs (NCCL, multicast off)" | tee -a "$LOG"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  python3 -m pytest -q -m gpu tests/test_expert_parallel.py -p no:cacheprovider -rf --tb=short 2>&1 | tee -a "$LOG" | tail -5
  torchrun --nproc-per-node 2 scripts/bench_expert_parallel.py --configs olmoe mixtral --out "$OUT/ep" \
    2>>"$LOG" | tee -a "$LOG"
fi
if [ "${PROFILE:-0}" = 1 ]; then
  echo "== profile" | tee -a "$LOG"
  python3 scripts/profile_step.py > "$OUT/profile.txt" 2>>"$LOG"; grep "^## " "$OUT/profile.txt" | tee -a "$LOG"
fi
