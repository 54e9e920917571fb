#!/usr/bin/env bash
# The GPU machine's one call: the GPU tests, then this tree's package beside an older copy
# of it, in the same call: the training benchmark (moeblaze eager and compiled) and the host
# time per step of a small layer (scripts/host_overhead.py). Prints a summary table last.
#
# Here, before the call: the older copy of the package (any commit; .ab/ is git-ignored),
#   rev=HEAD; rm -rf .ab/old && mkdir -p .ab/old && git archive "$rev" moeblaze_ops lowerings \
#     | tar -x -C .ab/old && git rev-parse --short "$rev" > .ab/old/REV
# The call (the device tool's run): command `bash scripts/gpu_check.sh`, carry [".ab"]
# (add ".whl" where wheels of test packages the machine lacks were downloaded: they are installed).
# Results under $OUT (gpu_out here): log.txt (everything printed), summary.md (the table
# printed last), bench/new1.json, bench/old1.json, ... (the benchmark's rows per side and round),
# decode_new/, decode_old/ (the decode benchmark's decode.md, .json, .png), generate/.
#
# Env: SKIP_TESTS=1, SKIP_BENCH=1, SKIP_HOST=1 leave parts out; DECODE=1 adds the decode
# benchmark of both sides (DECODE_CONFIGS="qwen3_a3b_decode mixtral_decode", DECODE_TOKENS="1 8 64
# 512"; DECODE_LAYERS=8 layers a graph, so the older side needs --layers-per-graph, c58f04e or
# later; the older side without compiled grouped_mm), GENERATE=1 HF generate's tokens/s of this tree
# (GENERATE_ARGS="--batch 1 32"); AB_OLD=<dir> the older copy
# (default .ab/old; without one, this tree alone); CONFIGS="olmoe mixtral conf4 deepseek_v3";
# ROUNDS=1 (benchmark runs per side, old and new alternating, their order turning each round;
# medians); TEST_WORKERS=6 (pytest-xdist processes sharing the GPU), TESTS_TIMEOUT=360 (s),
# TESTS_K=<pytest -k expression>; BENCH_TIMEOUT=300 (s, each benchmark run); HOST_ROUNDS=2 (host-time
# runs per side and mode, alternating; the least counts); HOST_CONFIG=qwen3_100m
# (the benchmark config whose layer host_overhead.py times). Extra arguments
# go to both sides' benchmark (e.g. --set column_slab=None: both packages must take them;
# --settle 3 times each peer after 3 s of steps, at the power limit's clocks, where the
# short timings of small steps can hide a change: both sides 891c390 or later).
# A call runs at most 10 minutes: where tests and benchmark together take longer, make two
# calls on the warm machine, SKIP_BENCH=1 then SKIP_TESTS=1.
set -uo pipefail
cd "$(dirname "$0")/.."
NEW=$PWD
OUT=$(realpath -m "${OUT:-gpu_out}")
AB_OLD=${AB_OLD:-.ab/old}
CONFIGS=${CONFIGS:-olmoe mixtral conf4 deepseek_v3}
HOST_CONFIG=${HOST_CONFIG:-qwen3_100m}
ROUNDS=${ROUNDS:-1}
WORK=$(mktemp -d /tmp/gpu_check.XXXX)
LOG=$OUT/log.txt
mkdir -p "$OUT/bench"
: > "$LOG"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
say() { echo "== $*" | tee -a "$LOG"; }

# A source tree without an install: the top-level lowerings/ become moeblaze_ops.lowerings
# through a link, as an install maps them.
link_lowerings() { [ -e "$1/moeblaze_ops/lowerings" ] || ln -s ../lowerings "$1/moeblaze_ops/lowerings"; }
link_lowerings "$NEW"
SIDES=(new)
if [ -d "$AB_OLD/moeblaze_ops" ]; then
  OLD=$(cd "$AB_OLD" && pwd)
  link_lowerings "$OLD"
  SIDES=(new old)
fi
root() { if [ "$1" = old ]; then echo "$OLD"; else echo "$NEW"; fi; }
# Wheels carried in .whl (test packages the machine lacks) go to /tmp/site, after each side's package.
SITE=
if [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; then
  SITE=/tmp/site
fi
pypath() { echo "$(root "$1")${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"; }
# Round r's order of the sides: new first in odd rounds, old first in even ones.
order() { if [ $(($1 % 2)) = 1 ]; then echo "${SIDES[@]}"; else printf '%s\n' "${SIDES[@]}" | tac | xargs; fi; }

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  PYTHONPATH=$(pypath new) python3 -c "import torch, triton, transformers; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
  if [ -n "${OLD:-}" ]; then echo "old: $OLD ($(cat "$OLD/REV" 2>/dev/null || echo 'no REV file'))"
  else echo "no older copy at $AB_OLD: this tree alone (the header says how to make one)"; fi
} 2>&1 | tee -a "$LOG"

TESTS="not run"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  say "GPU tests"
  workers=()
  PYTHONPATH=$(pypath new) python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-6}")
  # A kernel that hangs ends the tests, not the call.
  PYTHONPATH=$(pypath new) timeout "${TESTS_TIMEOUT:-360}" python3 -m pytest -q -m gpu tests/ -p no:cacheprovider \
    -rf --tb=short --durations=5 "${workers[@]}" ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$WORK/tests.txt" >> "$LOG"
  rc=${PIPESTATUS[0]}
  tail -15 "$WORK/tests.txt"
  TESTS=$(grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected)" "$WORK/tests.txt" | tail -1 | sed "s/^=* *//; s/ *=*$//")
  [ "$rc" = 124 ] && TESTS="stopped after ${TESTS_TIMEOUT:-360} s: ${TESTS:-no summary}"
  [ -z "$TESTS" ] && TESTS="exit code $rc, no summary (log.txt)"
fi

# The benchmark's peers other than moeblaze eager and compiled, left out; each side's
# benchmark is given those it knows (an older one refuses a name it has not).
SKIP_PEERS="hf_eager hf_grouped_mm hf_grouped_mm_compiled moeblaze_recompute moeblaze_recompute_compiled moeblaze_compiled_autograd moeblaze_fp8 sonicmoe"
known_peers() {
  local side=$1; shift
  PYTHONPATH=$(pypath "$side") python3 -c "import sys
from moeblaze_ops.bench.implementations import PEER_NAMES
print(' '.join(name for name in sys.argv[1:] if name in PEER_NAMES))" "$@"
}

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for round in $(seq "$ROUNDS"); do
    for side in $(order "$round"); do
      say "bench train, $side, round $round"
      # From the side's own root: `python -m` puts the working directory first on sys.path.
      (cd "$(root "$side")" && PYTHONPATH=$(pypath "$side") timeout "${BENCH_TIMEOUT:-300}" \
        python3 -m moeblaze_ops.bench --mode train --no-dispatch --configs $CONFIGS --out "$WORK/$side$round" \
        --skip $(known_peers "$side" $SKIP_PEERS) "$@") 2>>"$LOG" | tee -a "$LOG"
      cp "$WORK/$side$round/bench.json" "$OUT/bench/$side$round.json" 2>/dev/null || say "no bench.json ($side)"
    done
  done
fi

if [ "${SKIP_HOST:-0}" != 1 ]; then
  for mode in eager compiled; do
    for round in $(seq "${HOST_ROUNDS:-2}"); do
      for side in $(order "$round"); do
        say "host time per step, $HOST_CONFIG $mode, $side"
        # The script of this tree, the package of the side.
        PYTHONPATH=$(pypath "$side") python3 scripts/host_overhead.py --config "$HOST_CONFIG" \
          $([ "$mode" = compiled ] && echo --compile) 2>>"$LOG" | tee -a "$LOG" "$WORK/host_${mode}_$side.txt"
      done
    done
  done
fi

if [ "${DECODE:-0}" = 1 ]; then
  for side in $(order 1); do
    say "bench decode, $side"
    skip=(); [ "$side" = old ] && skip=(--skip grouped_mm_compiled)
    (cd "$(root "$side")" && PYTHONPATH=$(pypath "$side") timeout "${BENCH_TIMEOUT:-300}" \
      python3 -m moeblaze_ops.bench --mode decode --configs ${DECODE_CONFIGS:-qwen3_a3b_decode mixtral_decode} \
      --tokens ${DECODE_TOKENS:-1 8 64 512} --layers-per-graph "${DECODE_LAYERS:-8}" --calls 100 --repeats 3 \
      "${skip[@]}" --out "$OUT/decode_$side") \
      2>>"$LOG" | grep "^|" | tee -a "$LOG"
  done
fi

if [ "${GENERATE:-0}" = 1 ]; then
  say "HF generate, new"
  PYTHONPATH=$(pypath new) timeout "${BENCH_TIMEOUT:-300}" python3 -m moeblaze_ops.bench.generate \
    ${GENERATE_ARGS:---batch 1 32} --out "$OUT/generate" 2>>"$LOG" | tee -a "$LOG"
fi

python3 - "$OUT" "$WORK" "$TESTS" "$HOST_CONFIG" <<'EOF' | tee "$OUT/summary.md"
import glob, json, os, re, statistics, sys

out, work, tests, host_config = sys.argv[1:]
rows = {}  # (config, peer) -> side -> [(ms, peak GB)]
for path in sorted(glob.glob(f"{out}/bench/*.json")):
    side = re.match(r"[a-z]+", os.path.basename(path)).group(0)
    for r in json.load(open(path)).get("train", []):
        case = r["config"] + (f" T={r['T']}" if "T" in r else "") + (f" tilt={r['tilt']:g}" if r.get("tilt") else "")
        rows.setdefault((case, r["peer"]), {}).setdefault(side, []).append((r["ms"], r["peak_gb"]))

def cell(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f}"

def ratio(old, new):
    return f"{old / new:.3f}x" if old and new else "-"

lines = ["## summary: the older copy against this tree (old/new above 1: this tree is faster)", "",
         "| what | old | new | old/new | peak GB old | peak GB new |", "| --- | --- | --- | --- | --- | --- |"]
for (config, peer), sides in rows.items():
    ms = {s: statistics.median(m for m, _ in v) for s, v in sides.items()}
    peak = {s: v[0][1] for s, v in sides.items()}
    lines.append(f"| train ms, {config}, {peer} | {cell(ms.get('old'))} | {cell(ms.get('new'))} | "
                 f"{ratio(ms.get('old'), ms.get('new'))} | {cell(peak.get('old'), 2)} | {cell(peak.get('new'), 2)} |")
for mode in ("eager", "compiled"):
    for what, pattern in (("host ms per step (profiler)", r"host ms per step ([0-9.]+)"),
                          ("wall ms per step (unprofiled)", r"wall ms per step unprofiled ([0-9.]+)")):
        host = {}
        for side in ("old", "new"):
            path = f"{work}/host_{mode}_{side}.txt"
            found = [float(v) for v in re.findall(pattern, open(path).read())] if os.path.exists(path) else []
            host[side] = min(found) if found else None
        if any(host.values()):
            lines.append(f"| {what}, {host_config} {mode} (min) | {cell(host['old'])} | {cell(host['new'])} | "
                         f"{ratio(host['old'], host['new'])} | | |")
lines += ["", f"GPU tests: {tests}"]
print("\n".join(lines))
EOF
cat "$OUT/summary.md" >> "$LOG"
