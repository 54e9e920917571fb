"""Triton kernels of the expert backward ops (DESIGN.md §4).

- ``_dh_kernel``: gathers the output-gradient rows of each routed row, multiplies by
  W_down^T (a grouped GEMM over the same tile schedule as the forward), recomputes the
  activation from h in the epilogue and writes dH; it also writes each row's partial
  products <g, a> per column tile, which ``_router_grad_kernel`` sums in a fixed order
  into the router gradient.
- ``_wgrad_kernel``: the weight gradients, one program per (expert, output tile), whose
  reduction runs over the expert's own row range; the down projection's B operand is
  w * act(h), recomputed; the up projection's is x, gathered. Bias gradients come from
  the same loop. No atomics. It runs before ``_dh_kernel``, so dH may overwrite h.
- The input gradient is the forward's up kernel over dH rows (no gather) and the
  forward's combine with unit weights: each token's K rows summed in order k = 0..K-1.

Every kernel is deterministic: fixed reduction orders, no float atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_activations as acts
from . import triton_experts as fwd
from .torch_experts import row_weights
from .triton_activations import ACT_CODES
from .triton_experts import (
    _activate, _empty, _load_act_operand, _num_programs, _num_tiles, _precision, _tile_of, _up_kernel,
    _weight_tile,
)


@triton.jit
def _dh_kernel(
    go_ptr, w_ptr, h_ptr, eti_ptr, rw_ptr, offsets_ptr, b_ptr, dh_ptr, part_ptr, bdot_ptr,
    LK, E, D, I, alpha, limit, n_parts,
    stride_gm, stride_we, stride_wk, stride_wn, stride_be, stride_hm, stride_dhm,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_TMA: tl.constexpr = False, W_KMAJOR: tl.constexpr = False, FAST_ACT: tl.constexpr = False,
):
    total = _num_tiles(offsets_ptr, E, LK, I, BLOCK_M, BLOCK_N, GROUPS)
    n_tiles = tl.cdiv(I, BLOCK_N)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        e, row0, rows, rmask, cols, cmask = _tile_of(tile, offsets_ptr, E, LK, I, BLOCK_M, BLOCK_N, GROUPS)
        n_idx = tile % n_tiles
        real = rmask & ((rows * 0 + e) < E)  # rows of a real expert (not the sentinel group)
        tok = tl.load(eti_ptr + rows, mask=real, other=0).to(tl.int64)
        g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # dL/da / w: grad_out[token] @ W_e
        if e < E:
            for k0 in range(0, D, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(go_ptr + tok[:, None] * stride_gm + ks[None, :], mask=real[:, None] & (ks < D)[None, :],
                            other=0.0)
                b = _weight_tile(w_ptr, e, k0, n_idx * BLOCK_N, stride_we, stride_wk, stride_wn, D, I, W_TMA, W_KMAJOR,
                                 BLOCK_K, BLOCK_N)
                g = tl.dot(a, b, g, input_precision=PRECISION)
        # Epilogue: recompute the activation from h, apply its derivative.
        hg, hu = _load_act_operand(h_ptr, row0, real, stride_hm, n_idx * BLOCK_N, I, ACT, INTERLEAVED, False,
                                   BLOCK_M, BLOCK_N)
        w = tl.load(rw_ptr + rows, mask=real, other=0.0)[:, None]
        out_rows = dh_ptr + rows.to(tl.int64)[:, None] * stride_dhm
        smask = rmask[:, None] & cmask[None, :]
        if ACT < 3:
            a, da_dg, da_du = acts.gated_grad(hg.to(tl.float32), hu.to(tl.float32), ACT, alpha, limit, FAST_ACT)
            dg = (g * w * da_dg).to(dh_ptr.dtype.element_ty)
            du = (g * w * da_du).to(dh_ptr.dtype.element_ty)
            if INTERLEAVED:
                tl.store(out_rows + 2 * cols[None, :], dg, mask=smask)
                tl.store(out_rows + 2 * cols[None, :] + 1, du, mask=smask)
            else:
                tl.store(out_rows + cols[None, :], dg, mask=smask)
                tl.store(out_rows + I + cols[None, :], du, mask=smask)
        else:
            a, da = acts.plain_grad(hg.to(tl.float32), ACT, FAST_ACT)
            tl.store(out_rows + cols[None, :], (g * w * da).to(dh_ptr.dtype.element_ty), mask=smask)
        a = tl.where(smask, a, 0.0)
        tl.store(part_ptr + rows.to(tl.int64) * n_parts + n_idx, tl.sum(g * a, axis=1), mask=rmask)
        if HAS_BIAS:
            if n_idx == 0:  # <grad_out[token], b_e>, once per row
                bd = tl.zeros((BLOCK_M,), dtype=tl.float32)
                if e < E:
                    for k0 in range(0, D, BLOCK_K):
                        ks = k0 + tl.arange(0, BLOCK_K)
                        go = tl.load(go_ptr + tok[:, None] * stride_gm + ks[None, :],
                                     mask=real[:, None] & (ks < D)[None, :], other=0.0).to(tl.float32)
                        bias = tl.load(b_ptr + e * stride_be + ks, mask=ks < D, other=0.0).to(tl.float32)
                        bd += tl.sum(go * bias[None, :], axis=1)
                tl.store(bdot_ptr + rows, bd, mask=rmask)


@triton.jit
def _router_grad_kernel(part_ptr, bdot_ptr, tim_ptr, offsets_ptr, out_ptr, LK, E, K, n_parts,
                        stride_o0, stride_o1, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat (token, k)
    inside = j < LK
    r = tl.load(tim_ptr + j, mask=inside, other=0).to(tl.int64)
    valid = inside & (r < tl.load(offsets_ptr + E))  # sentinels: zero
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in range(0, n_parts):  # fixed order
        acc += tl.load(part_ptr + r * n_parts + p, mask=valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bdot_ptr + r, mask=valid, other=0.0)
    tl.store(out_ptr + (j // K) * stride_o0 + (j % K) * stride_o1, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _wgrad_step(acc, bias_acc, a_src, b_src, eti_ptr, rw_ptr, r0, hi, ps, pmask, qs, q0, Q, I, alpha, limit,
                stride_am, stride_bm, bias_here, DOWN: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
                HAS_BIAS: tl.constexpr, FAST_ACT: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr,
                SWAP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_Q: tl.constexpr, BIAS_COLS: tl.constexpr):
    """One reduction step over rows [r0, r0 + BLOCK_R): acc += A^T B, and the bias
    gradient's share (sum over rows of A, weighted by w for DOWN) where ``bias_here``.

    With TMA (DOWN only), h comes through a TMA descriptor. Only the last step of an expert
    (MASKED) needs row masks: there, rows past ``hi`` belong to the next expert and are zeroed.
    SWAP (DOWN only) computes the transposed product, acc [Q, P] += B^T A: the computed
    operand w * act(h) becomes the MMA's A, which the tensor cores read from registers,
    instead of its B, which must go through shared memory; its bias share comes from the
    tensor cores too ([BIAS_COLS, P]: row 0 of the left operand holds w, the rest 0).
    Otherwise ``bias_acc`` is [BLOCK_P, BIAS_COLS]: the down projection's share (BIAS_COLS
    = 1) is a register sum of w * A^T; the up projection's (BIAS_COLS = 16) comes from the
    tensor cores (A^T times a column of ones), so A^T never leaves shared memory. Its
    register sum gave wrong, run-to-run different dW_gate_up on the H200 with 256-row P
    tiles and the transposed layout's output strides (docs/perf-notes.md).
    """
    rows = r0 + tl.arange(0, BLOCK_R)
    rmask = rows < hi
    if MASKED:
        tok = tl.load(eti_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        tok = tl.load(eti_ptr + rows).to(tl.int64)
    if DOWN:
        w = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
        hg, hu = _load_act_operand(b_src, r0, rmask, stride_bm, q0, I, ACT, INTERLEAVED, TMA, BLOCK_R, BLOCK_Q)
        # The router weight rides on the computed operand: one multiply per element.
        b = _activate(hg, hu, alpha, limit, ACT, FAST_ACT) * w[:, None]
        if MASKED:
            b = tl.where(rmask[:, None], b, 0.0)
        b = b.to(a_src.dtype.element_ty)
        if SWAP:
            go = tl.load(a_src + tok[:, None] * stride_am + ps[None, :], mask=rmask[:, None] & pmask[None, :],
                         other=0.0)
            acc = tl.dot(tl.trans(b), go, acc, input_precision=PRECISION)
            if HAS_BIAS:
                if bias_here:
                    wsel = tl.where((tl.arange(0, BIAS_COLS) == 0)[:, None], w[None, :], 0.0)
                    bias_acc = tl.dot(wsel.to(go.dtype), go, bias_acc, input_precision=PRECISION)
        else:
            # A^T: gathered grad_out rows, read P-major, which the MMA takes from shared memory as is.
            at = tl.load(a_src + tok[None, :] * stride_am + ps[:, None], mask=pmask[:, None] & rmask[None, :],
                         other=0.0)
            acc = tl.dot(at, b, acc, input_precision=PRECISION)
            if HAS_BIAS:
                if bias_here:
                    bias_acc += tl.sum(at.to(tl.float32) * w[None, :], axis=1, keep_dims=True)
    else:
        at = tl.load(a_src + rows.to(tl.int64)[None, :] * stride_am + ps[:, None],
                     mask=pmask[:, None] & rmask[None, :], other=0.0)
        b = tl.load(b_src + tok[:, None] * stride_bm + qs[None, :], mask=rmask[:, None] & (qs < Q)[None, :],
                    other=0.0)
        acc = tl.dot(at, b, acc, input_precision=PRECISION)
        if HAS_BIAS:
            if bias_here:  # column 0 of the ones operand is 1, the rest 0: the sum lands in column 0
                ones = (tl.arange(0, BLOCK_R)[:, None] >= 0) & (tl.arange(0, BIAS_COLS)[None, :] == 0)
                bias_acc = tl.dot(at, ones.to(at.dtype), bias_acc, input_precision=PRECISION)
    return acc, bias_acc


@triton.jit
def _wgrad_kernel(
    a_src, b_src, eti_ptr, rw_ptr, offsets_ptr, out_ptr, bias_out_ptr,
    E, P, Q, I, alpha, limit,
    stride_am, stride_bm, stride_oe, stride_op, stride_oq, stride_be,
    DOWN: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    FAST_ACT: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BIAS_COLS: tl.constexpr,
    SWAP: tl.constexpr = False,
):
    """out[e] = sum over the expert's rows r of A[r]^T B[r] ([P, Q] per expert).

    DOWN: A[r] = grad_out[token_r] (P = d), B[r] = w_r * act(h[r]) (Q = I).
    else: A[r] = dH[r] (P = N), B[r] = x[token_r] (Q = d).
    One program per (expert, p-tile, q-tile) at a time, q fastest: neighbours share A.
    SWAP (DOWN only) accumulates out[e]^T: see ``_wgrad_step``.
    """
    p_tiles = tl.cdiv(P, BLOCK_P)
    q_tiles = tl.cdiv(Q, BLOCK_Q)
    for tile in range(tl.program_id(0), E * p_tiles * q_tiles, tl.num_programs(0)):
        e = tile // (p_tiles * q_tiles)
        p_idx = (tile // q_tiles) % p_tiles
        q_idx = tile % q_tiles
        ps = p_idx * BLOCK_P + tl.arange(0, BLOCK_P)
        qs = q_idx * BLOCK_Q + tl.arange(0, BLOCK_Q)
        pmask = ps < P
        lo = tl.load(offsets_ptr + e)
        hi = tl.load(offsets_ptr + e + 1)
        if SWAP:
            acc = tl.zeros((BLOCK_Q, BLOCK_P), dtype=tl.float32)
            bias_acc = tl.zeros((BIAS_COLS, BLOCK_P), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
            bias_acc = tl.zeros((BLOCK_P, BIAS_COLS), dtype=tl.float32)
        q0 = q_idx * BLOCK_Q
        if DOWN:
            # Whole steps without row masks, then one masked step for the expert's last rows.
            full = (hi - lo) // BLOCK_R
            for i in range(0, full):
                acc, bias_acc = _wgrad_step(acc, bias_acc, a_src, b_src, eti_ptr, rw_ptr, lo + i * BLOCK_R, hi, ps,
                                            pmask, qs, q0, Q, I, alpha, limit, stride_am, stride_bm, q_idx == 0,
                                            DOWN, ACT, INTERLEAVED, HAS_BIAS, FAST_ACT, TMA, False, SWAP, PRECISION,
                                            BLOCK_P, BLOCK_R, BLOCK_Q, BIAS_COLS)
            if lo + full * BLOCK_R < hi:
                acc, bias_acc = _wgrad_step(acc, bias_acc, a_src, b_src, eti_ptr, rw_ptr, lo + full * BLOCK_R, hi,
                                            ps, pmask, qs, q0, Q, I, alpha, limit, stride_am, stride_bm, q_idx == 0,
                                            DOWN, ACT, INTERLEAVED, HAS_BIAS, FAST_ACT, TMA, True, SWAP, PRECISION,
                                            BLOCK_P, BLOCK_R, BLOCK_Q, BIAS_COLS)
        else:
            # Every step masked: peeled like the above, this loop differed run to run on the
            # H200 (with the register bias sum) and faulted (with the tensor-core one).
            for r0 in range(lo, hi, BLOCK_R):
                acc, bias_acc = _wgrad_step(acc, bias_acc, a_src, b_src, eti_ptr, rw_ptr, r0, hi, ps, pmask, qs,
                                            q0, Q, I, alpha, limit, stride_am, stride_bm, q_idx == 0,
                                            DOWN, ACT, INTERLEAVED, HAS_BIAS, FAST_ACT, TMA, True, SWAP, PRECISION,
                                            BLOCK_P, BLOCK_R, BLOCK_Q, BIAS_COLS)
        qmask = qs < Q
        if SWAP:
            tl.store(out_ptr + e.to(tl.int64) * stride_oe + qs[:, None] * stride_oq + ps[None, :] * stride_op,
                     acc.to(out_ptr.dtype.element_ty), mask=qmask[:, None] & pmask[None, :])
            bias = tl.sum(bias_acc, axis=0)  # exact: one non-zero row
        else:
            tl.store(out_ptr + e.to(tl.int64) * stride_oe + ps[:, None] * stride_op + qs[None, :] * stride_oq,
                     acc.to(out_ptr.dtype.element_ty), mask=pmask[:, None] & qmask[None, :])
            bias = tl.sum(bias_acc, axis=1)  # exact: one non-zero column
        if HAS_BIAS:
            if q_idx == 0:
                tl.store(bias_out_ptr + e * stride_be + ps, bias.to(bias_out_ptr.dtype.element_ty), mask=pmask)


# --------------------------------------------------------------------------- launchers


#: The down projection's weight gradient accumulated transposed, the recomputed w * act(h)
#: as the MMA's register operand (tuning switch; scripts/tune_backward.py --swap). H200:
#: OLMoE-like 4.90 -> 4.35 ms, Mixtral-like 19.5 -> 18.4 ms; same errors, deterministic.
WGRAD_DOWN_SWAP = True
#: The dH epilogue's sigmoid as one approximate tanh for 16-bit CUDA tensors, as in the
#: forward down GEMM (tuning switch; scripts/tune_backward.py --dh-fast). H200: OLMoE-like
#: 3.04 -> 2.70 ms, Mixtral-like 9.61 -> 9.50 ms; errors within the bf16 tolerance.
DH_FAST_ACT = True


def _gemm_config(dtype, kind):
    """Tile shapes of the backward GEMMs: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, programs
    per SM]) for "dh" and "dx", (BLOCK_P, BLOCK_Q, BLOCK_R, warps, stages[, programs per SM])
    for "wgrad_down" and "wgrad_up" (scripts/tune_backward.py sweeps them; docs/perf-notes.md
    has the numbers)."""
    if dtype == torch.float32:
        return 64, 64, 32, 4, 3
    return {
        "dh": (128, 128, 64, 8, 4),
        "dx": (128, 256, 64, 8, 4),
        "wgrad_down": (256, 128, 64, 8, 3),
        "wgrad_up": (256, 128, 64, 8, 3),
    }[kind]


def _tiles(device, dtype, kind):
    return fwd._tiles(device, dtype, kind, _gemm_config)


def _launch_dh(grad_out, h, w_down, eti, rw, offsets, b_down, grad_h, parts, bdot, act, transposed, interleaved,
               alpha, limit):
    d = w_down.shape[2] if transposed else w_down.shape[1]
    I = w_down.shape[1] if transposed else w_down.shape[2]
    tiles = _tiles(h.device, h.dtype, "dh")
    # grad_out rows @ W_e as [d, I]: the forward's product transposed (reduction over d).
    swe, swk, swn = fwd._weight_strides(w_down, not transposed)
    w_src, w_tma, w_kmajor = fwd._weight_source(w_down, swk, tiles[2], tiles[1], "dh")
    fwd._launch_gemm(
        _dh_kernel, h.device, h.dtype, tiles, I,
        go_ptr=grad_out, w_ptr=w_src, h_ptr=h, eti_ptr=eti, rw_ptr=rw, offsets_ptr=offsets,
        b_ptr=b_down if b_down is not None else w_down, dh_ptr=grad_h, part_ptr=parts, bdot_ptr=bdot,
        LK=h.shape[0], E=w_down.shape[0], D=d, I=I, alpha=float(alpha), limit=float(limit), n_parts=parts.shape[1],
        stride_gm=grad_out.stride(0), stride_we=swe, stride_wk=swk, stride_wn=swn,
        stride_be=b_down.stride(0) if b_down is not None else 0, stride_hm=h.stride(0), stride_dhm=grad_h.stride(0),
        ACT=act, INTERLEAVED=interleaved, HAS_BIAS=b_down is not None, W_TMA=w_tma, W_KMAJOR=w_kmajor,
        FAST_ACT=DH_FAST_ACT and fwd._fast_act(h),
    )


def _launch_wgrad(a, b, eti, rw, offsets, grad_w, grad_b, P, Q, I, transposed_out, down, act, interleaved,
                  alpha, limit):
    E = grad_w.shape[0]
    BP, BQ, BR, warps, stages, *per_sm = _tiles(a.device, a.dtype, "wgrad_down" if down else "wgrad_up")
    a_stride, b_stride = a.stride(0), b.stride(0)
    # h's [BR, BQ] tiles through TMA, as in the forward down GEMM; dH keeps plain loads (see the kernel).
    b, tma = fwd._h_source(b, act, interleaved, I, BR, BQ) if down else (b, False)
    # grad_w is [E, P, Q], or [E, Q, P] when the weight layout is transposed.
    sop, soq = (grad_w.stride(2), grad_w.stride(1)) if transposed_out else (grad_w.stride(1), grad_w.stride(2))
    tiles = E * triton.cdiv(P, BP) * triton.cdiv(Q, BQ)
    _wgrad_kernel[(_num_programs(grad_w.device, tiles, *per_sm),)](
        a, b, eti, rw, offsets, grad_w, grad_b if grad_b is not None else grad_w,
        E, P, Q, I, float(alpha), float(limit),
        a_stride, b_stride, grad_w.stride(0), sop, soq, grad_b.stride(0) if grad_b is not None else 0,
        DOWN=down, ACT=act, INTERLEAVED=interleaved, HAS_BIAS=grad_b is not None, FAST_ACT=fwd._fast_act(grad_w),
        TMA=tma, PRECISION=_precision(grad_w.dtype), BLOCK_P=BP, BLOCK_Q=BQ, BLOCK_R=BR,
        BIAS_COLS=1 if down and not WGRAD_DOWN_SWAP else 16,  # the bias share's width: see _wgrad_step
        SWAP=down and WGRAD_DOWN_SWAP, num_warps=warps, num_stages=stages,
    )


def _launch_dx_rows(grad_h, w_gate_up, offsets, grad_rows, transposed):
    """dX rows = dH @ W_e with W_e as [N, d]: the forward's up kernel, without the gather."""
    LK, N = grad_h.shape
    d = grad_rows.shape[1]
    tiles = _tiles(grad_h.device, grad_h.dtype, "dx")
    swe, swk, swn = fwd._weight_strides(w_gate_up, not transposed)  # the forward's product transposed
    w_src, w_tma, w_kmajor = fwd._weight_source(w_gate_up, swk, tiles[2], tiles[1], "dx")
    fwd._launch_gemm(
        _up_kernel, grad_h.device, grad_h.dtype, tiles, d,
        x_ptr=grad_h, w_ptr=w_src, b_ptr=w_gate_up, eti_ptr=offsets, offsets_ptr=offsets, h_ptr=grad_rows,
        LK=LK, E=w_gate_up.shape[0], N=d, D=N, stride_xm=grad_h.stride(0), stride_xk=1,
        stride_we=swe, stride_wk=swk, stride_wn=swn, stride_be=0, stride_hm=grad_rows.stride(0),
        HAS_BIAS=False, GATHER=False, W_TMA=w_tma, W_KMAJOR=w_kmajor,
    )


def expert_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                         topk_weights, b_down, activation, transposed, interleaved, alpha, limit, in_place=False,
                         need_weight_grad=True):
    """``in_place`` writes dH over ``h`` (contiguous) and returns h as grad_h: the weight
    gradient, which reads all of h, runs first, and each dH tile overwrites only the h
    tiles it has just read. Without ``need_weight_grad`` the weight and bias gradients are
    returned empty and their kernel does not run."""
    L, K = topk_weights.shape
    LK = h.shape[0]
    E = w_down.shape[0]
    d = w_down.shape[2] if transposed else w_down.shape[1]
    I = w_down.shape[1] if transposed else w_down.shape[2]
    grad_out = grad_out.contiguous()
    if in_place:
        assert h.is_contiguous(), "in-place dH needs a contiguous h"
    h = h.contiguous()
    act = ACT_CODES[activation]
    dev = h.device
    rw = row_weights(token_index_map, topk_weights, torch.float32)
    grad_h = h if in_place else _empty(LK, h.shape[1], dtype=h.dtype, device=dev)
    grad_w = _empty(*w_down.shape, dtype=w_down.dtype, device=dev) if need_weight_grad else w_down.new_empty(0)
    has_grad_b = b_down is not None and need_weight_grad
    grad_b = _empty(*b_down.shape, dtype=b_down.dtype, device=dev) if has_grad_b else h.new_empty(0)
    grad_tw = _empty(L, K, dtype=topk_weights.dtype, device=dev)
    n_parts = max(1, triton.cdiv(I, _tiles(dev, h.dtype, "dh")[1]))
    parts = torch.empty(LK, n_parts, dtype=torch.float32, device=dev)
    bdot = torch.empty(LK, dtype=torch.float32, device=dev)
    # The weight gradient first: it reads all of h, which dH may overwrite.
    if need_weight_grad:
        _launch_wgrad(grad_out, h, expert_token_indices, rw, expert_offsets, grad_w, grad_b if has_grad_b else None,
                      d, I, I, transposed, True, act, interleaved, alpha, limit)
    if LK > 0:
        _launch_dh(grad_out, h, w_down, expert_token_indices, rw, expert_offsets, b_down, grad_h, parts, bdot, act,
                   transposed, interleaved, alpha, limit)
        BLOCK = 256
        _router_grad_kernel[(triton.cdiv(LK, BLOCK),)](
            parts, bdot, token_index_map, expert_offsets, grad_tw, LK, E, K, n_parts,
            grad_tw.stride(0), grad_tw.stride(1), HAS_BIAS=b_down is not None, BLOCK=BLOCK,
        )
    else:
        grad_tw.zero_()
    return grad_h, grad_w, grad_b, grad_tw


def expert_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                       has_bias, transposed, need_input_grad=True, need_weight_grad=True):
    LK, N = grad_h.shape
    E = w_gate_up.shape[0]
    L, d = x.shape
    dev = x.device
    grad_h = grad_h.contiguous()
    grad_w = _empty(*w_gate_up.shape, dtype=w_gate_up.dtype, device=dev) if need_weight_grad else x.new_empty(0)
    grad_b = _empty(E, N, dtype=x.dtype, device=dev) if has_bias and need_weight_grad else x.new_empty(0)
    grad_x = _empty(L, d, dtype=x.dtype, device=dev) if need_input_grad else x.new_empty(0)
    if need_input_grad:  # each token's K rows of dH @ W, summed in order (unit weights)
        fwd.combine_in_slabs(
            lambda rows, c0, c1: _launch_dx_rows(grad_h, fwd.weight_columns(w_gate_up, c0, c1, 1 if transposed else 2),
                                                 expert_offsets, rows, transposed),
            LK, x.dtype, token_index_map, None, expert_offsets, grad_x, E)
    if need_weight_grad:
        _launch_wgrad(grad_h, x.contiguous(), expert_token_indices, grad_h, expert_offsets, grad_w,
                      grad_b if has_bias else None, N, d, 0, transposed, False, 0, False, 0.0, 0.0)
    return grad_x, grad_w, grad_b
