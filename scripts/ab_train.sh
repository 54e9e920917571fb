#!/usr/bin/env bash
# Same-machine A/B of the training step: moeblaze of this checkout against an older copy of
# the package in $1 (a folder holding moeblaze_ops/), alternating runs so drift shows.
#   bash scripts/ab_train.sh OLD_DIR [configs...]
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=$1; shift
CONFIGS=${*:-olmoe conf4 mixtral}
OUT=$(realpath -m "${OUT:-ab_out}")
mkdir -p "$OUT"
SKIP="hf_eager hf_grouped_mm hf_grouped_mm_compiled moeblaze_compiled moeblaze_recompute moeblaze_recompute_compiled"
for round in 1 2; do
  for side in new old; do
    root=$PWD; [ "$side" = old ] && root=$(cd "$OLD" && pwd)
    # Run from the package's own folder: `python -m` puts the working directory first on sys.path.
    (cd "$root" && PYTHONPATH=$root python3 -m moeblaze_ops.bench --mode train --no-dispatch --configs $CONFIGS \
      --skip $SKIP --out "$OUT/$side$round" 2>/dev/null) | grep "| moeblaze |" | sed "s/^/$side round $round: /"
  done
done
