"""Sweeps tile configs of the backward GEMM kernels on benchmark shapes (GPU).

    python scripts/tune_backward.py [--configs olmoe mixtral] [--kinds dh dx wgrad_down wgrad_up]
        [--w-tma 0 1] [--swap 0 1] [--dh-fast 0 1]

Each kernel is timed on its own (dh includes the router-gradient reduce, dx the unit-weight
combine) next to a dense cuBLAS matmul of the same FLOPs: the ceiling to aim at.
"""

import argparse

import torch
import triton.testing

from moeblaze_ops.bench import CONFIGS, make_inputs
from moeblaze_ops.kernels import triton_dispatch, triton_experts as te, triton_experts_backward as tb
from moeblaze_ops.kernels.torch_experts import row_weights
from moeblaze_ops.kernels.triton_activations import ACT_CODES

TILES = {  # (BM|BP, BN|BQ, BK|BR, warps, stages[, programs per SM])
    "dh": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 3, 2), (128, 128, 32, 8, 4),
           (128, 256, 64, 8, 3)],
    "dx": [(128, 256, 64, 8, 4), (128, 256, 64, 8, 3)],
    "wgrad_down": [(256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 32, 8, 4),
                   (128, 128, 64, 8, 3), (128, 128, 64, 8, 3, 2)],
    "wgrad_up": [(256, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 8, 3, 2), (128, 128, 64, 8, 4, 2),
                 (128, 128, 64, 4, 3, 2)],
}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")


def kernels(T, d, I, E, K, device="cuda"):
    """kind -> (callable running that backward kernel on the shape, its FLOPs)."""
    x, ids, w, wgu, wd = make_inputs(T, d, I, E, K, device=device)
    eti, offs, tim = triton_dispatch.dispatch(ids, E)
    LK = T * K
    h = te.expert_up(x, wgu, eti, offs, tim, None, False)
    go = torch.randn(T, d, device=device, dtype=x.dtype)
    rw = row_weights(tim, w, torch.float32)
    grad_h = torch.empty_like(h)
    parts = torch.empty(LK, triton.cdiv(I, 64), dtype=torch.float32, device=device)
    bdot = torch.empty(LK, dtype=torch.float32, device=device)
    grad_wd, grad_wgu = torch.empty_like(wd), torch.empty_like(wgu)
    rows = torch.empty(LK, d, device=device, dtype=x.dtype)
    gx = torch.empty_like(x)
    act = ACT_CODES["swiglu"]

    def dh():
        n_parts = triton.cdiv(I, tb._tiles(h.device, h.dtype, "dh")[1])
        part = parts.view(-1)[:LK * n_parts].view(LK, n_parts)  # contiguous, as the kernel indexes it
        tb._launch_dh(go, h, wd, eti, rw, offs, None, grad_h, part, bdot, act, False, False, 1.702, 7.0)

    def dx():
        tb._launch_dx_rows(h, wgu, offs, rows, False)
        te.combine(rows, tim, None, offs, gx, E)

    def wgrad_down():
        tb._launch_wgrad(go, h, eti, rw, offs, grad_wd, None, d, I, I, False, True, act, False, 1.702, 7.0)

    def wgrad_up():
        tb._launch_wgrad(h, x, eti, h, offs, grad_wgu, None, 2 * I, d, 0, False, False, 0, False, 0.0, 0.0)

    f = 2 * LK * d * I
    return {"dh": (dh, f), "dx": (dx, 2 * f), "wgrad_down": (wgrad_down, f), "wgrad_up": (wgrad_up, 2 * f)}


def variants(kind, a):
    """(label, switch setter) per variant of ``kind`` the command line asks for."""
    if kind == "dh":
        return [(f"w_tma={v} fast={f}", lambda v=v, f=f: (te.W_TMA.update({kind: bool(v)}),
                                                          setattr(tb, "DH_FAST_ACT", bool(f))))
                for v in a.w_tma for f in a.dh_fast]
    if kind == "dx":
        return [(f"w_tma={v}", lambda v=v: te.W_TMA.update({kind: bool(v)})) for v in a.w_tma]
    if kind == "wgrad_down":
        return [(f"swap={v}", lambda v=v: setattr(tb, "WGRAD_DOWN_SWAP", bool(v))) for v in a.swap]
    return [("", lambda: None)]


def main():
    defaults = dict(te.W_TMA), tb.WGRAD_DOWN_SWAP, tb.DH_FAST_ACT
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="*", default=["olmoe", "mixtral"])
    p.add_argument("--kinds", nargs="*", default=list(TILES), choices=list(TILES))
    p.add_argument("--tiles", nargs="*", default=None, help="BM,BN,BK,warps,stages ... (for every kind)")
    p.add_argument("--w-tma", nargs="*", type=int, default=[0, 1],
                   help="weight tiles through TMA (1) or not (0): dh and dx read weights")
    p.add_argument("--swap", nargs="*", type=int, default=[0, 1], help="wgrad_down accumulated transposed (1) or not")
    p.add_argument("--dh-fast", nargs="*", type=int, default=[0, 1], help="dH epilogue with the approximate sigmoid")
    a = p.parse_args()
    for name in a.configs:
        T, d, I, E, K = CONFIGS[name]
        LK = T * K
        dense_a = torch.randn(LK, d, device="cuda", dtype=torch.bfloat16)
        dense_b = torch.randn(d, I, device="cuda", dtype=torch.bfloat16)
        dense = 2 * LK * d * I / bench(lambda: dense_a @ dense_b) / 1e9
        del dense_a, dense_b
        print(f"\n{name} LK={LK} d={d} I={I} E={E}: cuBLAS dense [LK,d]x[d,I] {dense:.0f} TFLOP/s", flush=True)
        fns = kernels(T, d, I, E, K)
        for kind in a.kinds:
            fn, flops = fns[kind]
            tiles = [tuple(int(v) for v in t.split(",")) for t in a.tiles] if a.tiles else TILES[kind]
            for tile, (variant, switch) in [(t, v) for t in tiles for v in variants(kind, a)]:
                te.CONFIG_OVERRIDE = {kind: tile}
                switch()
                label = f"  {kind:10s} tile={tile} {variant}"
                try:
                    ms = bench(fn)
                    print(f"{label}: {ms:7.3f} ms {flops / ms / 1e9:4.0f} TFLOP/s", flush=True)
                except Exception as e:  # out of shared memory etc.
                    print(f"{label}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            te.CONFIG_OVERRIDE, te.W_TMA = {}, dict(defaults[0])
            tb.WGRAD_DOWN_SWAP, tb.DH_FAST_ACT = defaults[1:]
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
