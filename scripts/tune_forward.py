"""Sweeps tile configs of the forward GEMM kernels on benchmark shapes (GPU).

    python scripts/tune_forward.py [--configs olmoe mixtral] [--w-tma 0 1] [--tiles BM,BN,BK,w,s ...]
        [--activations swiglu relu] [--row-band 1 8 16]

``--activations relu`` times the down projection with an almost free activation pass
(ReLU of the first I columns of h): the gap to swiglu is what the activation's math
costs there.

Prints, per shape and kernel, the time and TFLOP/s of each config next to a dense cuBLAS
matmul of the same size (the ceiling to aim at).
"""

import argparse

import torch
import triton.testing

from moeblaze_ops import settings
from moeblaze_ops.activations import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT
from moeblaze_ops.bench import CONFIGS, make_inputs
from moeblaze_ops.kernels import triton_dispatch, triton_experts as te
from moeblaze_ops.settings import GemmTile

TILES = [
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
    (64, 256, 64, 4, 4), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4),
]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="*", default=["olmoe", "mixtral"])
    p.add_argument("--programs-per-sm", nargs="*", type=int, default=[1, 2])
    p.add_argument("--kinds", nargs="*", default=["up", "down"], choices=["up", "down"])
    p.add_argument("--tiles", nargs="*", default=None, help="BM,BN,BK,warps,stages ...")
    p.add_argument("--fast-act", nargs="*", type=int, default=[1], help="approximate-tanh sigmoid (1) or exact (0)")
    p.add_argument("--w-tma", nargs="*", type=int, default=[0, 1],
                   help="the GEMM's weight tiles through TMA (1) or not (0)")
    p.add_argument("--activations", nargs="*", default=["swiglu"], help="the down kernel's activation(s)")
    p.add_argument("--row-band", nargs="*", type=int, default=[settings.current().row_band],
                   help="the tile order's band of row tiles (settings.row_band)")
    a = p.parse_args()
    tiles = [tuple(int(v) for v in t.split(",")) for t in a.tiles] if a.tiles else TILES
    base_w_tma = settings.current().weight_tma
    for name in a.configs:
        T, d, I, E, K = CONFIGS[name]
        x, ids, w, wgu, wd = make_inputs(T, d, I, E, K)
        eti, offs, tim = triton_dispatch.dispatch(ids, E)
        LK = T * K
        h = te.expert_up(x, wgu, eti, offs, tim, None, False)
        dense_a = torch.randn(LK, d, device="cuda", dtype=torch.bfloat16)
        dense_up = bench(lambda: dense_a @ wgu[0].t())
        dense_h = torch.randn(LK, I, device="cuda", dtype=torch.bfloat16)
        dense_down = bench(lambda: dense_h @ wd[0].t())
        up_flops, down_flops = 2 * LK * d * 2 * I, 2 * LK * I * d
        print(f"\n{name} LK={LK} d={d} I={I} E={E}: cuBLAS dense up {up_flops / dense_up / 1e9:.0f} TFLOP/s, "
              f"down {down_flops / dense_down / 1e9:.0f} TFLOP/s")
        jobs = ([("up", None)] if "up" in a.kinds else []) + [("down", act) for act in a.activations
                                                               if "down" in a.kinds]
        for pps in a.programs_per_sm:
            for tile, fast, w_tma, band in [(t, f, w, b) for t in tiles for f in a.fast_act for w in a.w_tma
                                            for b in a.row_band]:
                row = []
                for kind, act in jobs:
                    changes = dict(tiles={kind: GemmTile(*tile, programs_per_sm=pps)}, fast_activation=bool(fast),
                                   row_band=band,
                                   weight_tma=(base_w_tma | {kind}) if w_tma else (base_w_tma - {kind}))
                    try:
                        with settings.override(**changes):
                            if kind == "up":
                                ms = bench(lambda: te.expert_up(x, wgu, eti, offs, tim, None, False))
                            else:
                                ms = bench(lambda: te.expert_down(h, wd, eti, offs, tim, w, None, act, False, False,
                                                                  CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT))
                        label = kind if act is None else f"down {act}"
                        row.append(f"{label} {ms:7.3f} ms {(up_flops if kind == 'up' else down_flops) / ms / 1e9:4.0f}")
                    except Exception as e:  # out of shared memory etc.
                        row.append(f"{kind} failed ({type(e).__name__})")
                print(f"  pps={pps} tile={tile} fast_act={fast} w_tma={w_tma} band={band}: "
                      + " | ".join(row), flush=True)
        del x, wgu, wd, h, dense_a, dense_h
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
