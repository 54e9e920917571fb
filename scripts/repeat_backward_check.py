"""Repeats a backward check of tests/test_gpu.py over seeds and kernel variants (a hunt for
wrong or run-to-run different gradients, GPU). Per variant and gradient it reports the
seeds whose two runs differed and the worst relative error against float64.

    python scripts/repeat_backward_check.py [--seeds 8] [--L 2048 --E 16 --K 2 --routing skewed]
        [--layouts concatenated transposed_interleaved] [--h-tma 1 0]
        [--up-tiles default 128,128,64,8,3] [--swap 0 1]

A variant is one choice from each of the last four lists (their product).
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_layer, rel_err  # noqa: E402
from reference import reference_moe  # noqa: E402

from moeblaze_ops import moe_experts  # noqa: E402
from moeblaze_ops.kernels import triton_experts, triton_experts_backward  # noqa: E402

NAMES = ("x", "topk_weights", "w_gate_up", "w_down", "b_gate_up", "b_down")


def grads(layer, g, ref=False):
    inputs = {k: (v.cuda().double() if ref else v.cuda()).requires_grad_(k in NAMES)
              if torch.is_tensor(v) and v.is_floating_point() else (v.cuda() if torch.is_tensor(v) else v)
              for k, v in layer.items()}
    out = (reference_moe if ref else moe_experts)(**inputs)
    return torch.autograd.grad(out, [inputs[n] for n in NAMES], g.to(out.dtype))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--L", type=int, default=2048)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--I", type=int, default=128)
    p.add_argument("--E", type=int, default=16)
    p.add_argument("--K", type=int, default=2)
    p.add_argument("--routing", default="skewed")
    p.add_argument("--layouts", nargs="*", default=["concatenated"])
    p.add_argument("--h-tma", nargs="*", type=int, default=[1, 0])
    p.add_argument("--up-tiles", nargs="*", default=["default"], help="wgrad_up tile BP,BQ,BR,warps,stages")
    p.add_argument("--swap", nargs="*", type=int, default=[int(triton_experts_backward.WGRAD_DOWN_SWAP)])
    a = p.parse_args()
    for layout, tma, tile, swap in itertools.product(a.layouts, a.h_tma, a.up_tiles, a.swap):
        triton_experts.H_TMA = bool(tma)
        triton_experts.CONFIG_OVERRIDE = {} if tile == "default" else {"wgrad_up": tuple(map(int, tile.split(",")))}
        triton_experts_backward.WGRAD_DOWN_SWAP = bool(swap)
        differ = {n: 0 for n in NAMES}
        worst = {n: 0.0 for n in NAMES}
        tr = layout != "concatenated"
        for seed in range(a.seeds):
            layer = make_layer(a.L, a.d, a.I, a.E, a.K, dtype=torch.bfloat16, bias=True, routing=a.routing,
                               transposed=tr, interleaved=tr, seed=seed)
            g = torch.randn(a.L, a.d, device="cuda", dtype=torch.float64)
            runs = [grads(layer, g) for _ in range(3)]
            ref = grads(layer, g, ref=True)
            for i, n in enumerate(NAMES):
                differ[n] += any(not torch.equal(runs[0][i], r[i]) for r in runs[1:])
                worst[n] = max(worst[n], rel_err(runs[0][i], ref[i]))
        print(f"{layout} h_tma={tma} up_tile={tile} swap={swap}: seeds differing (of {a.seeds}) {differ}; "
              f"worst rel err {{{', '.join(f'{n}: {e:.1e}' for n, e in worst.items())}}}", flush=True)
    triton_experts.CONFIG_OVERRIDE = {}


if __name__ == "__main__":
    main()
