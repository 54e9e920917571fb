"""What the partial row tiles cost: the layer (forward, and forward + backward) with the
benchmark's uniform random routing against a routing that gives every expert exactly
L*K/E rows, so no 128-row tile runs past its expert's end; and, with ``--tiles``, the
row GEMMs (up, down, dX) on other tiles (GPU).

    python3 scripts/tile_padding.py [--configs deepseek_v3 qwen3_a3b] [--tiles 64,256,64,4,4 ...]

Each line names the routing, the row tiles the routing makes at 128 rows (and the count
if no expert had a partial one), and the medians of ``triton.testing.do_bench``.
"""

import argparse
import math

import torch
import triton.testing

import moeblaze_ops
from moeblaze_ops import settings
from moeblaze_ops.bench import CONFIGS, make_inputs
from moeblaze_ops.settings import GemmTile


def balanced_ids(T, K, E, device="cuda"):
    """[T, K] expert ids giving every expert T*K/E rows (K distinct experts a token when K <= E)."""
    return torch.arange(T * K, device=device).view(T, K) % E


def time_layer(x, ids, w, w_gate_up, w_down):
    """(forward ms, forward + backward ms) of ``moe_experts`` on these inputs."""
    grad_out = torch.randn_like(x)
    xg, wg, wd = (t.detach().requires_grad_(True) for t in (x, w_gate_up, w_down))

    def forward():
        with torch.no_grad():
            moeblaze_ops.moe_experts(x, ids, w, w_gate_up, w_down)

    def step():
        xg.grad = wg.grad = wd.grad = None
        moeblaze_ops.moe_experts(xg, ids, w, wg, wd).backward(grad_out)

    return (triton.testing.do_bench(forward, warmup=10, rep=200, return_mode="median"),
            triton.testing.do_bench(step, warmup=5, rep=300, return_mode="median"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="*", default=["deepseek_v3", "qwen3_a3b"], choices=sorted(CONFIGS))
    p.add_argument("--tiles", nargs="*", default=[], help="BM,BN,BK,warps,stages for up, down and dX (random routing)")
    args = p.parse_args()
    for name in args.configs:
        T, d, I, E, K = CONFIGS[name]
        x, ids, w, w_gate_up, w_down = make_inputs(T, d, I, E, K)
        runs = [("random", ids, {}), ("balanced", balanced_ids(T, K, E), {})]
        runs += [(f"random, row tiles {t}", ids, {k: GemmTile(*map(int, t.split(","))) for k in ("up", "down", "dx")})
                 for t in args.tiles]
        for label, routing, tiles in runs:
            counts = torch.bincount(routing.flatten(), minlength=E).tolist()
            row_tiles = sum(math.ceil(c / 128) for c in counts)
            with settings.override(tiles=tiles):
                fwd, step = time_layer(x, routing, w, w_gate_up, w_down)
            print(f"{name} {label}: 128-row tiles {row_tiles} (none partial: {T * K // 128}), forward {fwd:.3f} ms, "
                  f"forward + backward {step:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
