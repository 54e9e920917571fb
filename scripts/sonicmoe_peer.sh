#!/usr/bin/env bash
# SonicMoE as a benchmark peer on a GPU machine without network. Its wheels (SonicMoE
# 0.1.2.post1, QuACK, the CuTe DSL, about 77 MB) are more than one device call carries, so
# they travel in two ignored folders, .peer-sonicmoe-1 (the small wheels and the first
# half of the DSL's libraries wheel) and .peer-sonicmoe-2 (the second half), in two calls
# made back to back while the machine stays up:
#
#   call 1, carrying .peer-sonicmoe-1:  bash scripts/sonicmoe_peer.sh stash; <other work>
#   call 2, carrying .peer-sonicmoe-2:  bash scripts/sonicmoe_peer.sh install &&
#       ln -sfn ../lowerings moeblaze_ops/lowerings &&   # the lowerings of a source tree
#       python3 -m moeblaze_ops.bench --mode train --no-dispatch --peer-site /tmp/peer-site \
#         --configs olmoe mixtral --skip hf_eager moeblaze_recompute moeblaze_recompute_compiled \
#         moeblaze_compiled_autograd
#       (or python3 scripts/profile_step.py --peer-site /tmp/peer-site --peers sonicmoe moeblaze)
#
# `install` puts the packages into /tmp/peer-site (pip --target, no dependencies: torch
# is the machine's); the benchmark and scripts/profile_step.py find them through
# --peer-site, which also reads the DSL's .pth file. The first call of each new shape
# JIT-compiles for minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
keep=/tmp/peer-keep
site=/tmp/peer-site
libs=nvidia_cutlass_dsl_libs_base-4.4.2-cp312-cp312-manylinux_2_28_x86_64.whl
case "${1:-}" in
stash)
  [ -d .peer-sonicmoe-1 ] || { echo "no .peer-sonicmoe-1 here: carry it into this call" >&2; exit 1; }
  mkdir -p "$keep" && cp -r .peer-sonicmoe-1 "$keep"/ && echo "stashed .peer-sonicmoe-1 in $keep" ;;
install)
  [ -d "$keep/.peer-sonicmoe-1" ] || { echo "run 'stash' in the call before, on this machine" >&2; exit 1; }
  [ -d .peer-sonicmoe-2 ] || { echo "no .peer-sonicmoe-2 here: carry it into this call" >&2; exit 1; }
  cat "$keep/.peer-sonicmoe-1/libs.part.aa" .peer-sonicmoe-2/libs.part.ab > "$keep/$libs"
  python3 -m pip install -q --no-index --no-deps --target "$site" "$keep"/.peer-sonicmoe-1/*.whl "$keep/$libs"
  python3 -c "import site; site.addsitedir('$site'); import sonicmoe; print('sonicmoe importable from $site')" ;;
*) echo "usage: $0 stash|install" >&2; exit 2 ;;
esac
