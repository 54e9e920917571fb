"""Triton kernels of the expert backward ops, on the ``grouped_gemm`` core.

- ``_dh_kernel``: gathers the output-gradient rows of each routed row, multiplies by
  W_down^T (a grouped GEMM on the forward's tile schedule), recomputes the activation
  from h in the epilogue and writes dH; it also writes each row's partial products
  <g, a> per column tile, which ``_router_grad_kernel`` sums in a fixed order into the
  router gradient.
- ``_wgrad_down_kernel``, ``_wgrad_up_kernel``: the weight gradients as grouped GEMMs
  whose reduction runs over each expert's own rows, one program per (expert, output
  tile) at a time, bias gradients from the same loop, no atomics. The down projection's
  B operand is w * act(h), recomputed; the up projection's is x, gathered. They run
  before ``_dh_kernel``, so dH may overwrite h.
- The input gradient is the forward's gathered GEMM over dH rows (no gather) and the
  combine with unit weights: each token's K rows summed in order k = 0..K-1.

Every kernel is deterministic: fixed reduction orders, no float atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import settings
from ..activations import activation_code
from ..layouts import in_feature_slice, linear_dims, linear_strides
from . import grouped_gemm as gg
from . import triton_activations as acts
from .torch_experts import row_weights
from .triton_combine import combine_in_slabs
from .triton_experts import launch_gathered_gemm


@triton.jit
def _dh_kernel(
    go_ptr, w_src, h_ptr, eti_ptr, rw_ptr, offsets_ptr, bias_ptr, dh_ptr, part_ptr, bdot_ptr,
    LK, E, D, I, alpha, limit, n_parts,
    stride_gm, stride_we, stride_wk, stride_wn, stride_bias, stride_hm, stride_dhm,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, W_TMA: tl.constexpr,
    W_KMAJOR: tl.constexpr, FAST_ACT: tl.constexpr, GROUPS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    total = gg.num_row_tiles(offsets_ptr, E, LK, I, BLOCK_M, BLOCK_N, GROUPS)
    n_tiles = tl.cdiv(I, BLOCK_N)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        e, row0, rows, rmask, cols, cmask = gg.row_tile(tile, offsets_ptr, E, LK, I, BLOCK_M, BLOCK_N, GROUPS)
        n_idx = tile % n_tiles
        real = rmask & ((rows * 0 + e) < E)  # rows of a real expert (not the sentinel group)
        tok = tl.load(eti_ptr + rows, mask=real, other=0).to(tl.int64)
        g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # dL/da / w: grad_out[token] @ W_e
        if e < E:
            for k0 in range(0, D, BLOCK_K):
                a = gg.load_rows(go_ptr, tok, real, k0, D, stride_gm, 1, BLOCK_K)
                b = gg.load_weight_tile(w_src, e, k0, n_idx * BLOCK_N, stride_we, stride_wk, stride_wn, D, I, W_TMA,
                                        W_KMAJOR, BLOCK_K, BLOCK_N)
                g = tl.dot(a, b, g, input_precision=PRECISION)
        # Epilogue: recompute the activation from h, apply its derivative.
        hg, hu = gg.load_h_pair(h_ptr, row0, real, stride_hm, n_idx * BLOCK_N, I, ACT, INTERLEAVED, False,
                                BLOCK_M, BLOCK_N)
        w = tl.load(rw_ptr + rows, mask=real, other=0.0)[:, None]
        out_rows = dh_ptr + rows.to(tl.int64)[:, None] * stride_dhm
        smask = rmask[:, None] & cmask[None, :]
        if ACT < acts.NUM_GATED:
            a, da_dg, da_du = acts.gated_grad(hg.to(tl.float32), hu.to(tl.float32), ACT, alpha, limit, FAST_ACT)
            # Both halves converted before either store: storing the first while the second
            # is still fp32 measured slower (docs/perf-notes.md).
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
                        go = gg.load_rows(go_ptr, tok, real, k0, D, stride_gm, 1, BLOCK_K).to(tl.float32)
                        bias = tl.load(bias_ptr + e * stride_bias + ks, mask=ks < D, other=0.0).to(tl.float32)
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
def _wgrad_down_step(acc, bias_acc, go_ptr, h_src, eti_ptr, rw_ptr, r0, hi, ps, pmask, q0, I, alpha, limit,
                     stride_gm, stride_hm, bias_here, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
                     HAS_BIAS: tl.constexpr, FAST_ACT: tl.constexpr, H_TMA: tl.constexpr, MASKED: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BIAS_ROWS: tl.constexpr):
    """One reduction step over rows [r0, r0 + BLOCK_R) of the transposed down-weight
    gradient: acc [Q, P] += (w * act(h))^T grad_out[tok]. The computed operand is the
    MMA's A, which the tensor cores read from registers (as B it would have to go through
    shared memory). The bias share comes from the tensor cores too: ``bias_acc``
    [BIAS_ROWS, P] += W^T grad_out[tok] with row 0 of W holding w and the rest 0.
    Only the expert's last step (MASKED) has rows past ``hi``, which belong to the next
    expert and are zeroed."""
    rows = r0 + tl.arange(0, BLOCK_R)
    rmask = rows < hi
    if MASKED:
        tok = tl.load(eti_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        tok = tl.load(eti_ptr + rows).to(tl.int64)
    w = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    hg, hu = gg.load_h_pair(h_src, r0, rmask, stride_hm, q0, I, ACT, INTERLEAVED, H_TMA, BLOCK_R, BLOCK_Q)
    # The router weight rides on the computed operand: one multiply per element.
    b = acts.activate(hg, hu, alpha, limit, ACT, FAST_ACT) * w[:, None]
    if MASKED:
        b = tl.where(rmask[:, None], b, 0.0)
    b = b.to(go_ptr.dtype.element_ty)
    go = tl.load(go_ptr + tok[:, None] * stride_gm + ps[None, :], mask=rmask[:, None] & pmask[None, :], other=0.0)
    acc = tl.dot(tl.trans(b), go, acc, input_precision=PRECISION)
    if HAS_BIAS:
        if bias_here:
            wsel = tl.where((tl.arange(0, BIAS_ROWS) == 0)[:, None], w[None, :], 0.0)
            bias_acc = tl.dot(wsel.to(go.dtype), go, bias_acc, input_precision=PRECISION)
    return acc, bias_acc


@triton.jit
def _wgrad_down_kernel(
    go_ptr, h_src, eti_ptr, rw_ptr, offsets_ptr, out_ptr, bias_out_ptr,
    E, P, Q, alpha, limit,
    stride_gm, stride_hm, stride_oe, stride_op, stride_oq, stride_bias,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_ACT: tl.constexpr,
    H_TMA: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BIAS_ROWS: tl.constexpr,
):
    """dW_down[e] = sum over the expert's rows r of grad_out[tok_r]^T (w_r * act(h[r]))
    ([P, Q] = [d, I] per expert), accumulated transposed; dB_down[e] = sum w_r grad_out[tok_r]."""
    for tile in range(tl.program_id(0), gg.num_expert_tiles(E, P, Q, BLOCK_P, BLOCK_Q), tl.num_programs(0)):
        e, lo, hi, q_idx, ps, pmask, qs, qmask = gg.expert_tile(tile, offsets_ptr, P, Q, BLOCK_P, BLOCK_Q)
        acc = tl.zeros((BLOCK_Q, BLOCK_P), dtype=tl.float32)
        bias_acc = tl.zeros((BIAS_ROWS, BLOCK_P), dtype=tl.float32)
        q0 = q_idx * BLOCK_Q
        # Whole steps without row masks, then one masked step for the expert's last rows.
        full = (hi - lo) // BLOCK_R
        for i in range(0, full):
            acc, bias_acc = _wgrad_down_step(acc, bias_acc, go_ptr, h_src, eti_ptr, rw_ptr, lo + i * BLOCK_R, hi, ps,
                                             pmask, q0, Q, alpha, limit, stride_gm, stride_hm, q_idx == 0, ACT,
                                             INTERLEAVED, HAS_BIAS, FAST_ACT, H_TMA, False, PRECISION, BLOCK_R,
                                             BLOCK_Q, BIAS_ROWS)
        if lo + full * BLOCK_R < hi:
            acc, bias_acc = _wgrad_down_step(acc, bias_acc, go_ptr, h_src, eti_ptr, rw_ptr, lo + full * BLOCK_R, hi,
                                             ps, pmask, q0, Q, alpha, limit, stride_gm, stride_hm, q_idx == 0, ACT,
                                             INTERLEAVED, HAS_BIAS, FAST_ACT, H_TMA, True, PRECISION, BLOCK_R,
                                             BLOCK_Q, BIAS_ROWS)
        tl.store(out_ptr + e.to(tl.int64) * stride_oe + qs[:, None] * stride_oq + ps[None, :] * stride_op,
                 acc.to(out_ptr.dtype.element_ty), mask=qmask[:, None] & pmask[None, :])
        if HAS_BIAS:
            if q_idx == 0:
                bias = tl.sum(bias_acc, axis=0)  # exact: one non-zero row
                tl.store(bias_out_ptr + e * stride_bias + ps, bias.to(bias_out_ptr.dtype.element_ty), mask=pmask)


@triton.jit
def _wgrad_up_step(acc, bias_acc, dh_ptr, x_ptr, eti_ptr, r0, hi, ps, pmask, q0, Q, stride_dhm, stride_xm, bias_here,
                   HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BIAS_COLS: tl.constexpr):
    """One reduction step over rows [r0, r0 + BLOCK_R): acc [P, Q] += dH^T x[tok]. The bias
    share comes from the tensor cores (dH^T times a column of ones, in ``bias_acc``
    [P, BIAS_COLS]), so dH^T never leaves shared memory."""
    rows = r0 + tl.arange(0, BLOCK_R)
    rmask = rows < hi
    tok = tl.load(eti_ptr + rows, mask=rmask, other=0).to(tl.int64)
    # dH^T, read P-major, which the MMA takes from shared memory as is.
    at = tl.load(dh_ptr + rows.to(tl.int64)[None, :] * stride_dhm + ps[:, None], mask=pmask[:, None] & rmask[None, :],
                 other=0.0)
    b = gg.load_rows(x_ptr, tok, rmask, q0, Q, stride_xm, 1, BLOCK_Q)
    acc = tl.dot(at, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        if bias_here:  # column 0 of the ones operand is 1, the rest 0: the sum lands in column 0
            ones = (tl.arange(0, BLOCK_R)[:, None] >= 0) & (tl.arange(0, BIAS_COLS)[None, :] == 0)
            bias_acc = tl.dot(at, ones.to(at.dtype), bias_acc, input_precision=PRECISION)
    return acc, bias_acc


@triton.jit
def _wgrad_up_kernel(
    dh_ptr, x_ptr, eti_ptr, offsets_ptr, out_ptr, bias_out_ptr,
    E, P, Q,
    stride_dhm, stride_xm, stride_oe, stride_op, stride_oq, stride_bias,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BIAS_COLS: tl.constexpr,
):
    """dW_gate_up[e] = sum over the expert's rows r of dH[r]^T x[tok_r] ([P, Q] = [N, d]
    per expert); dB_gate_up[e] = sum dH[r]."""
    for tile in range(tl.program_id(0), gg.num_expert_tiles(E, P, Q, BLOCK_P, BLOCK_Q), tl.num_programs(0)):
        e, lo, hi, q_idx, ps, pmask, qs, qmask = gg.expert_tile(tile, offsets_ptr, P, Q, BLOCK_P, BLOCK_Q)
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
        bias_acc = tl.zeros((BLOCK_P, BIAS_COLS), dtype=tl.float32)
        # Every step masked: peeled like the down kernel's, this loop differed run to run
        # and faulted on the H200 (docs/perf-notes.md).
        for r0 in range(lo, hi, BLOCK_R):
            acc, bias_acc = _wgrad_up_step(acc, bias_acc, dh_ptr, x_ptr, eti_ptr, r0, hi, ps, pmask, q_idx * BLOCK_Q,
                                           Q, stride_dhm, stride_xm, q_idx == 0, HAS_BIAS, PRECISION, BLOCK_R,
                                           BLOCK_Q, BIAS_COLS)
        tl.store(out_ptr + e.to(tl.int64) * stride_oe + ps[:, None] * stride_op + qs[None, :] * stride_oq,
                 acc.to(out_ptr.dtype.element_ty), mask=pmask[:, None] & qmask[None, :])
        if HAS_BIAS:
            if q_idx == 0:
                bias = tl.sum(bias_acc, axis=1)  # exact: one non-zero column
                tl.store(bias_out_ptr + e * stride_bias + ps, bias.to(bias_out_ptr.dtype.element_ty), mask=pmask)


# --------------------------------------------------------------------------- launchers

#: Width of the tensor-core bias accumulators of the weight gradients (the MMA's smallest N).
_BIAS_WIDTH = 16


def _wgrad_grid(grad_w, tile, P, Q):
    tiles = grad_w.shape[0] * triton.cdiv(P, tile.block_m) * triton.cdiv(Q, tile.block_n)
    return (gg.num_programs(grad_w.device, tiles, tile.programs_per_sm),)


def launch_wgrad_down(grad_out, h, eti, rw, offsets, grad_w, grad_b, *, act, interleaved, alpha, limit,
                       transposed):
    """dW_down (and dB_down when ``grad_b``): P = d, Q = I, reduction over each expert's rows."""
    _, P, Q = linear_dims(grad_w, transposed)
    tile = gg.tile_config("wgrad_down", h)
    # h's [BR, BQ] tiles through TMA, as in the forward down GEMM.
    h_src, h_tma = gg.h_operand(h, act, interleaved, Q, tile.block_k, tile.block_n)
    out_strides = linear_strides(grad_w, transposed)
    _wgrad_down_kernel[_wgrad_grid(grad_w, tile, P, Q)](
        grad_out, h_src, eti, rw, offsets, grad_w, grad_b, grad_w.shape[0], P, Q, float(alpha), float(limit),
        grad_out.stride(0), h.stride(0), out_strides.expert, out_strides.output, out_strides.reduction,
        grad_b.stride(0) if grad_b is not None else 0,
        ACT=int(act), INTERLEAVED=interleaved, HAS_BIAS=grad_b is not None,
        FAST_ACT=gg.fast_sigmoid(grad_w, settings.current().fast_activation), H_TMA=h_tma,
        PRECISION=gg.precision(grad_w.dtype), BLOCK_P=tile.block_m, BLOCK_Q=tile.block_n, BLOCK_R=tile.block_k,
        BIAS_ROWS=_BIAS_WIDTH, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def launch_wgrad_up(grad_h, x, eti, offsets, grad_w, grad_b, *, transposed):
    """dW_gate_up (and dB_gate_up when ``grad_b``): P = N, Q = d, reduction over each expert's rows."""
    _, P, Q = linear_dims(grad_w, transposed)
    tile = gg.tile_config("wgrad_up", grad_h)
    out_strides = linear_strides(grad_w, transposed)
    _wgrad_up_kernel[_wgrad_grid(grad_w, tile, P, Q)](
        grad_h, x, eti, offsets, grad_w, grad_b, grad_w.shape[0], P, Q,
        grad_h.stride(0), x.stride(0), out_strides.expert, out_strides.output, out_strides.reduction,
        grad_b.stride(0) if grad_b is not None else 0,
        HAS_BIAS=grad_b is not None, PRECISION=gg.precision(grad_w.dtype), BLOCK_P=tile.block_m,
        BLOCK_Q=tile.block_n, BLOCK_R=tile.block_k, BIAS_COLS=_BIAS_WIDTH, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def launch_dh(grad_out, h, w_down, eti, rw, offsets, b_down, grad_h, parts, bdot, *, act, transposed,
               interleaved, alpha, limit):
    E, d, I = linear_dims(w_down, transposed)
    tile = gg.tile_config("dh", h)
    # grad_out rows @ W_e as [d, I]: the forward's product transposed (reduction over d).
    strides = linear_strides(w_down, not transposed)
    w_src, w_tma, w_kmajor = gg.weight_operand(w_down, strides.reduction, tile, "dh")
    gg.launch_row_gemm(
        _dh_kernel, tile, h.dtype, h.device, I,
        go_ptr=grad_out, w_src=w_src, h_ptr=h, eti_ptr=eti, rw_ptr=rw, offsets_ptr=offsets, bias_ptr=b_down,
        dh_ptr=grad_h, part_ptr=parts, bdot_ptr=bdot,
        LK=h.shape[0], E=E, D=d, I=I, alpha=float(alpha), limit=float(limit), n_parts=parts.shape[1],
        stride_gm=grad_out.stride(0), stride_we=strides.expert, stride_wk=strides.reduction,
        stride_wn=strides.output, stride_bias=b_down.stride(0) if b_down is not None else 0,
        stride_hm=h.stride(0), stride_dhm=grad_h.stride(0),
        ACT=int(act), INTERLEAVED=interleaved, HAS_BIAS=b_down is not None, W_TMA=w_tma, W_KMAJOR=w_kmajor,
        FAST_ACT=gg.fast_sigmoid(h, settings.current().dh_fast_activation),
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
    E, _, I = linear_dims(w_down, transposed)
    grad_out = grad_out.contiguous()
    if in_place and not h.is_contiguous():
        raise ValueError("moeblaze.expert_down_backward_: argument 'h' must be contiguous (it is overwritten)")
    h = h.contiguous()
    act = activation_code(activation)
    dev = h.device
    rw = row_weights(token_index_map, topk_weights, torch.float32)
    grad_h = h if in_place else gg.empty(LK, h.shape[1], dtype=h.dtype, device=dev)
    grad_w = gg.empty(*w_down.shape, dtype=w_down.dtype, device=dev) if need_weight_grad else w_down.new_empty(0)
    has_grad_b = b_down is not None and need_weight_grad
    grad_b = gg.empty(*b_down.shape, dtype=b_down.dtype, device=dev) if has_grad_b else h.new_empty(0)
    grad_tw = gg.empty(L, K, dtype=topk_weights.dtype, device=dev)
    n_parts = max(1, triton.cdiv(I, gg.tile_config("dh", h).block_n))
    parts = torch.empty(LK, n_parts, dtype=torch.float32, device=dev)
    bdot = torch.empty(LK, dtype=torch.float32, device=dev)
    # The weight gradient first: it reads all of h, which dH may overwrite.
    if need_weight_grad:
        launch_wgrad_down(grad_out, h, expert_token_indices, rw, expert_offsets, grad_w,
                           grad_b if has_grad_b else None, act=act, interleaved=interleaved, alpha=alpha,
                           limit=limit, transposed=transposed)
    if LK > 0:
        launch_dh(grad_out, h, w_down, expert_token_indices, rw, expert_offsets, b_down, grad_h, parts, bdot,
                   act=act, transposed=transposed, interleaved=interleaved, alpha=alpha, limit=limit)
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
    grad_w = gg.empty(*w_gate_up.shape, dtype=w_gate_up.dtype, device=dev) if need_weight_grad else x.new_empty(0)
    grad_b = gg.empty(E, N, dtype=x.dtype, device=dev) if has_bias and need_weight_grad else x.new_empty(0)
    grad_x = gg.empty(L, d, dtype=x.dtype, device=dev) if need_input_grad else x.new_empty(0)
    if need_input_grad:
        # Each token's K rows of dH @ W_e^T (the up product transposed: reduction over N),
        # summed in order with unit weights.
        def dx_rows(rows, c0, c1):
            w = in_feature_slice(w_gate_up, c0, c1, transposed)
            launch_gathered_gemm(grad_h, None, w, None, expert_offsets, rows, not transposed, "dx")

        combine_in_slabs(dx_rows, LK, x.dtype, token_index_map, None, expert_offsets, grad_x, E)
    if need_weight_grad:
        launch_wgrad_up(grad_h, x.contiguous(), expert_token_indices, expert_offsets, grad_w,
                         grad_b if has_bias else None, transposed=transposed)
    return grad_x, grad_w, grad_b
