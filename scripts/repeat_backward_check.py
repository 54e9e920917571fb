"""Repeats a backward check of tests/test_gpu.py over seeds and kernel variants (a hunt for
wrong or run-to-run different gradients, GPU). Per variant and gradient it reports the
seeds whose three runs did not all agree and the worst relative error against float64.

    python scripts/repeat_backward_check.py [--seeds 8] [--L 2048 --E 16 --K 2 --routing skewed]
        [--layouts concatenated transposed_interleaved] [--h-tma 1 0]
        [--up-tiles default 128,128,64,8,3]

A variant is one choice from each of the last three lists (their product).
"""

import argparse
import itertools

import torch

from moeblaze_ops import moe_experts, settings
from moeblaze_ops.settings import GemmTile
from moeblaze_ops.testing import LAYOUTS, make_layer, reference_moe, rel_err

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
    p.add_argument("--layouts", nargs="*", default=["concatenated"], choices=list(LAYOUTS))
    p.add_argument("--up-tiles", nargs="*", default=["default"], help="wgrad_up tile BP,BQ,BR,warps,stages")
    a = p.parse_args()
    for layout, tile in itertools.product(a.layouts, a.up_tiles):
        tiles = {} if tile == "default" else {"wgrad_up": GemmTile(*map(int, tile.split(",")))}
        differ = {n: 0 for n in NAMES}
        worst = {n: 0.0 for n in NAMES}
        # small_gemm_flop=0: the Gluon weight gradients at this small size too, as on large layers.
        with settings.override(tiles=tiles, small_gemm_flop=0):
            for seed in range(a.seeds):
                layer = make_layer(a.L, a.d, a.I, a.E, a.K, dtype=torch.bfloat16, bias=True, routing=a.routing,
                                   layout=layout, seed=seed)
                g = torch.randn(a.L, a.d, device="cuda", dtype=torch.float64)
                runs = [grads(layer, g) for _ in range(3)]
                ref = grads(layer, g, ref=True)
                for i, n in enumerate(NAMES):
                    differ[n] += any(not torch.equal(runs[0][i], r[i]) for r in runs[1:])
                    worst[n] = max(worst[n], rel_err(runs[0][i], ref[i]))
        print(f"{layout} up_tile={tile}: seeds differing (of {a.seeds}) {differ}; "
              f"worst rel err {{{', '.join(f'{n}: {e:.1e}' for n, e in worst.items())}}}", flush=True)


if __name__ == "__main__":
    main()
