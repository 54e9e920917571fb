"""Sweeps tile configs of the backward GEMM kernels on benchmark shapes (GPU).

    python scripts/tune_backward.py [--configs olmoe mixtral] [--kinds dh dx wgrad_down wgrad_up]
        [--w-tma 0 1] [--dh-fast 0 1] [--dh-columns None 64 32] [--dh-gluon 0 1] [--dh-slots None 2 4] [--gluon 0 1] [--ws 0 1] [--rows-tma 0 1] [--tma-store 0 1]
        [--row-band 1 8]
        [--wgrad-band 1 8 16]

Each kernel is timed on its own (dh without the router-gradient reduce, dx with the
unit-weight combine) next to a dense cuBLAS matmul of the same FLOPs: the ceiling to aim at.
"""

import argparse
import functools
from unittest import mock

import torch
import triton.testing

from moeblaze_ops import settings
from moeblaze_ops.activations import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT, activation_code
from moeblaze_ops.bench import CONFIGS, make_inputs
from moeblaze_ops.kernels import gluon_dh, triton_dispatch, triton_experts as te, triton_experts_backward as tb
from moeblaze_ops.kernels.triton_combine import combine
from moeblaze_ops.settings import GemmTile

TILES = {  # (BM|BP, BN|BQ, BK|BR, warps, stages[, programs per SM])
    "dh": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 3, 2), (128, 128, 32, 8, 4),
           (128, 256, 64, 8, 3)],
    "dx": [(128, 256, 64, 8, 4), (128, 256, 64, 8, 3)],
    # The Gluon kernels take block_m = 16 * warps, or with --rows-tma 1 block_n = 16 * warps
    # (the others fail there and say so); 256 x 128 x 64 x 8 x 4 is the rows-TMA default.
    "wgrad_down": [(128, 256, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 4),
                   (256, 128, 64, 8, 3), (256, 128, 32, 8, 8)],
    "wgrad_up": [(128, 256, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 4),
                 (256, 128, 64, 8, 3), (256, 128, 32, 8, 8)],
}
#: The narrowest dH tile a sweep may ask for: sizes the buffer of per-tile router partials.
MIN_DH_BLOCK_N = 16


def bench(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")


def kernels(T, d, I, E, K, device="cuda"):
    """kind -> (callable running that backward kernel on the shape, its FLOPs). Each reads
    its tile from the settings in force when it is called."""
    x, ids, w, wgu, wd = make_inputs(T, d, I, E, K, device=device)
    eti, offs, tim = triton_dispatch.dispatch(ids, E)
    LK = T * K
    h = te.expert_up(x, wgu, eti, offs, tim, None, False)
    go = torch.randn(T, d, device=device, dtype=x.dtype)
    grad_h = torch.empty_like(h)
    wact = torch.empty(LK, I, device=device, dtype=x.dtype)
    parts = torch.empty(LK * triton.cdiv(I, MIN_DH_BLOCK_N), dtype=torch.float32, device=device)
    bdot = torch.empty(LK, dtype=torch.float32, device=device)
    grad_wd, grad_wgu = torch.empty_like(wd), torch.empty_like(wgu)
    rows = torch.empty(LK, d, device=device, dtype=x.dtype)
    gx = torch.empty_like(x)
    swiglu = dict(act=activation_code("swiglu"), interleaved=False, alpha=CLAMPED_SWIGLU_ALPHA,
                  limit=CLAMPED_SWIGLU_LIMIT)

    def dh():
        gluon = tb.dh_gluon_module(go, h, wd, act=swiglu["act"], transposed=False, interleaved=False, has_bias=False)
        n_parts = triton.cdiv(I, tb.dh_part_columns(gluon, h, I))
        part = parts[:LK * n_parts].view(LK, n_parts)  # contiguous, as the kernel indexes it
        tb.launch_dh(gluon, go, h, wd, eti, w, tim, offs, None, grad_h, wact, part, bdot, transposed=False, **swiglu)

    def dx():  # h stands in for dH (same shape)
        te.launch_gathered_gemm(h, None, wgu, None, offs, rows, True, "dx")
        combine(rows, tim, None, offs, gx, E)

    def wgrad_down():
        tb.launch_wgrad(wact, go, eti, offs, grad_wd.transpose(1, 2), kind="wgrad_down")

    def wgrad_up():
        tb.launch_wgrad(h, x, eti, offs, grad_wgu, kind="wgrad_up")

    f = 2 * LK * d * I
    return {"dh": (dh, f), "dx": (dx, 2 * f), "wgrad_down": (wgrad_down, f), "wgrad_up": (wgrad_up, 2 * f)}


def variants(kind, a):
    """(label, settings changes, chunks of h in flight in the Gluon dH or None) per variant
    of ``kind`` the command line asks for."""
    base = settings.current().weight_tma

    def w_tma(v):
        return (base | {kind}) if v else (base - {kind})

    if kind == "dh":
        # dh_wide_min_columns=None: every width takes the "dh" tile, which --tiles sets.
        # dh_gluon=1: the Gluon kernel (tiles of 16 rows a warp; others fail there and say
        # so); the weight TMA and the columns are the tl kernel's.
        gluon = settings.current().gluon
        return [(f"gluon={g} w_tma={v} fast={f} band={b} epilogue_columns={c}" + (f" h_slots={n}" if g else ""),
                 dict(weight_tma=w_tma(v), dh_fast_activation=bool(f), row_band=b, dh_epilogue_columns=c,
                      dh_wide_min_columns=None, small_gemm_flop=0,
                      gluon=(gluon | {kind}) if g else (gluon - {kind})), n)
                for g in a.dh_gluon for v in (a.w_tma if not g else [1]) for f in a.dh_fast for b in a.row_band
                for c in (a.dh_columns if not g else [None]) for n in (a.dh_slots if g else [None])]
    if kind == "dx":
        return [(f"w_tma={v} band={b}", dict(weight_tma=w_tma(v), row_band=b), None) for v in a.w_tma
                for b in a.row_band]
    gluon, ws, rows_tma = (settings.current().gluon, settings.current().gluon_warp_specialize,
                           settings.current().wgrad_rows_tma)
    return [(f"gluon={v} ws={w}" + (f" rows_tma={t} tma_store={s} group={g}" if v else "")
             + (f" split_mma={m}" if v and w and t else ""),
             dict(gluon=(gluon | {kind}) if v else (gluon - {kind}), small_gemm_flop=0,
                  gluon_warp_specialize={**{k: r for k, r in ws.items() if k != kind}, **({kind: 0} if w else {})},
                  wgrad_rows_tma={**{k: r for k, r in rows_tma.items() if k != kind}, **({kind: 0} if t else {})},
                  wgrad_tma_store=bool(s), wgrad_band=g, wgrad_split_mma={kind} if m else set()), None)
            for v in a.gluon for w in (a.ws if v else [0]) for t in (a.rows_tma if v else [0])
            for m in ((a.split_mma if a.split_mma is not None else [int(kind in settings.current().wgrad_split_mma)])
                      if v and w and t else [0])
            for s in (a.tma_store if v and (t or not w) else [0])
            for g in (a.wgrad_band if v else [1])]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="*", default=["olmoe", "mixtral"])
    p.add_argument("--kinds", nargs="*", default=list(TILES), choices=list(TILES))
    p.add_argument("--tiles", nargs="*", default=None,
                   help="BM,BN,BK,warps,stages[,programs per SM] ... (for every kind)")
    p.add_argument("--w-tma", nargs="*", type=int, default=[0, 1],
                   help="weight tiles through TMA (1) or not (0): dh and dx read weights")
    p.add_argument("--dh-fast", nargs="*", type=int, default=[0, 1], help="dH epilogue with the approximate sigmoid")
    p.add_argument("--dh-columns", nargs="*", type=lambda v: None if v == "None" else int(v),
                   default=[settings.current().dh_epilogue_columns],
                   help="columns of the dH epilogue's slices (settings.dh_epilogue_columns; None: the whole tile)")
    p.add_argument("--dh-gluon", nargs="*", type=int, default=[0],
                   help="dh on the Gluon kernel (1; tiles of 16 rows a warp) or the tl one (0)")
    p.add_argument("--dh-slots", nargs="*", type=lambda v: None if v == "None" else int(v), default=[None],
                   help="the Gluon dH kernel's chunks of h in flight (None: as many as shared memory holds)")
    p.add_argument("--gluon", nargs="*", type=int, default=[1, 0],
                   help="weight gradients on the Gluon kernel (1) or the portable tl one (0)")
    p.add_argument("--ws", nargs="*", type=int, default=[0, 1],
                   help="the Gluon weight gradients warp-specialised (1) or not (0)")
    p.add_argument("--rows-tma", nargs="*", type=int, default=[0],
                   help="the Gluon weight gradients with the row-ordered operand by TMA (1; tiles P=256, "
                        "Q=16*warps) or not (0)")
    p.add_argument("--tma-store", nargs="*", type=int, default=[0],
                   help="Gluon weight gradients (all but the warp-specialised one without --rows-tma): output tiles written by TMA from "
                        "shared memory (1) or from registers (0)")
    p.add_argument("--split-mma", nargs="*", type=int, default=None,
                   help="the warp-specialised rows-TMA weight gradients with each MMA warpgroup a partition of its "
                        "own (1) or both in one (0) (default: as settings.wgrad_split_mma has the kind)")
    p.add_argument("--row-band", nargs="*", type=int, default=[settings.current().row_band],
                   help="dh and dx: the tile order's band of row tiles (settings.row_band)")
    p.add_argument("--wgrad-band", nargs="*", type=int, default=[settings.current().wgrad_band],
                   help="the Gluon weight gradients' band of tile rows (settings.wgrad_band)")
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
            for tile, (variant, changes, slots) in [(t, v) for t in tiles for v in variants(kind, a)]:
                label = f"  {kind:10s} tile={tile} {variant}"
                try:
                    launch_dh = functools.partial(gluon_dh.launch_dh, slots=slots)  # the unpatched one
                    with settings.override(tiles={kind: GemmTile(*tile)}, **changes), \
                            mock.patch.object(gluon_dh, "launch_dh", launch_dh):
                        ms = bench(fn)
                    print(f"{label}: {ms:7.3f} ms {flops / ms / 1e9:4.0f} TFLOP/s", flush=True)
                except Exception as e:  # out of shared memory etc.
                    print(f"{label}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
