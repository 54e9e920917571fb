"""Triton kernels of the expert backward ops, on the ``grouped_gemm`` core.

- ``_dh_kernel``: gathers the output-gradient rows of each routed row, multiplies by
  W_down^T (a grouped GEMM on the forward's tile schedule), recomputes the activation
  from h in the epilogue and writes dH (over h, in place, when asked) and w * act(h);
  it also writes each row's partial products <g, a> per column tile, which
  ``_router_grad_kernel`` sums in a fixed order into the router gradient.
- ``_wgrad_kernel``: both weight gradients, as one grouped GEMM whose reduction runs
  over each expert's own rows: out[e] = A_e^T B[ids], A row-ordered (dH, or w * act(h)
  from the dH epilogue: every operand comes from memory), B gathered token rows (x, or
  the output gradient); one program per (expert, output tile) at a time, no atomics.
  ``_expert_row_sum_kernel`` sums the bias gradients in a fixed order.
- The input gradient is the forward's gathered GEMM over dH rows (no gather) and the
  combine with unit weights: each token's K rows summed in order k = 0..K-1.

Every kernel is deterministic: fixed reduction orders, no float atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import settings
from ...activations import activation_code
from ...layouts import in_feature_slice, linear_dims, linear_strides
from .. import config
from . import grouped_gemm as gg
from . import activations as acts
from ..launch import launch
from .combine import combine_in_slabs, row_combine_weights, widest_slab
from .experts import launch_gathered_gemm


@triton.jit
def _column_half(t, UPPER: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """The lower or upper half of the columns of a [BLOCK_M, WIDTH] tile (a register
    renaming, for the accumulator's layout)."""
    lower, upper = tl.split(tl.permute(tl.reshape(t, (BLOCK_M, 2, WIDTH // 2)), (0, 2, 1)))
    out = lower
    if UPPER:
        out = upper
    return out


@triton.jit
def _column_slice(t, S: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Columns [S * WIDTH / PARTS, (S + 1) * WIDTH / PARTS) of a [BLOCK_M, WIDTH] tile, PARTS 1, 2 or 4."""
    if PARTS == 1:
        out = t
    elif PARTS == 2:
        out = _column_half(t, S == 1, BLOCK_M, WIDTH)
    else:
        out = _column_half(_column_half(t, S >= 2, BLOCK_M, WIDTH), S % 2 == 1, BLOCK_M, WIDTH // 2)
    return out


@triton.jit
def dh_outputs(g, w, hg, hu, rows, rmask, cols, cmask, n0, I, dh_ptr, wact_ptr, stride_dhm, stride_wam, alpha, limit,
               ACT: tl.constexpr, INTERLEAVED: tl.constexpr, WRITE_WACT: tl.constexpr, FAST_ACT: tl.constexpr,
               WIDTH: tl.constexpr):
    """What dH's epilogue computes and writes on ``rows`` and activation columns ``cols``
    ([n0, n0 + WIDTH)): from ``g`` = dL/da / w, the combine weights ``w`` ([rows, 1]) and
    the raw h tiles ``hg, hu`` (``grouped_gemm.load_h_pair``), it writes dH (and w *
    act(h) with WRITE_WACT) and returns each row's <g, act(h)> over these columns, for
    the router gradient. Both dH kernels call it (``gluon.dh`` with its own layouts, never
    INTERLEAVED)."""
    smask = rmask[:, None] & cmask[None, :]
    dg, du, a = acts.backward(g * w, hg, hu, alpha, limit, ACT, FAST_ACT)
    out_rows = dh_ptr + rows.to(tl.int64)[:, None] * stride_dhm
    if ACT < acts.NUM_GATED:
        # Both halves converted before either store: storing the first while the second
        # is still fp32 measured slower (docs/perf-notes.md).
        dg = dg.to(dh_ptr.dtype.element_ty)
        du = du.to(dh_ptr.dtype.element_ty)
        if INTERLEAVED:
            # Gate and up columns alternate: one contiguous store of both, as h was read
            # (two stores of every other element each cannot be vectorised).
            cols2 = 2 * n0 + tl.arange(0, 2 * WIDTH)
            tl.store(out_rows + cols2[None, :], tl.interleave(dg, du), mask=rmask[:, None] & (cols2 < 2 * I)[None, :])
        else:
            out = out_rows + cols[None, :]
            tl.store(out, dg, mask=smask)
            tl.store(out + I, du, mask=smask)
    else:
        tl.store(out_rows + cols[None, :], dg.to(dh_ptr.dtype.element_ty), mask=smask)
    if WRITE_WACT:  # w * act(h): the down weight gradient's operand, read from memory there
        tl.store(wact_ptr + rows.to(tl.int64)[:, None] * stride_wam + cols[None, :],
                 (w * a).to(wact_ptr.dtype.element_ty), mask=smask)
    return tl.sum(g * tl.where(smask, a, 0.0), axis=1)


@triton.jit
def _dh_epilogue(g, w, row0, rows, real, rmask, n0, I, h_ptr, dh_ptr, wact_ptr, stride_hm, stride_dhm, stride_wam,
                 alpha, limit, ACT: tl.constexpr, INTERLEAVED: tl.constexpr, WRITE_WACT: tl.constexpr,
                 FAST_ACT: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """dH's epilogue on activation columns [n0, n0 + WIDTH) of the tile: the h tiles
    behind them, then ``dh_outputs``. ``g`` is dL/da / w."""
    cols = n0 + tl.arange(0, WIDTH)
    hg, hu = gg.load_h_pair(h_ptr, row0, real, stride_hm, n0, I, ACT, INTERLEAVED, BLOCK_M, WIDTH)
    return dh_outputs(g, w, hg, hu, rows, rmask, cols, cols < I, n0, I, dh_ptr, wact_ptr, stride_dhm, stride_wam,
                      alpha, limit, ACT, INTERLEAVED, WRITE_WACT, FAST_ACT, WIDTH)


@triton.jit
def _dh_kernel(
    go_ptr, w_src, h_ptr, eti_ptr, tw_ptr, tim_ptr, offsets_ptr, bias_ptr, dh_ptr, wact_ptr, part_ptr, bdot_ptr,
    LK, E, D, I, alpha, limit, n_parts,
    stride_gm, stride_we, stride_wk, stride_wn, stride_bias, stride_hm, stride_dhm, stride_wam, stride_tw0, stride_tw1,
    K: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_WACT: tl.constexpr,
    W_TMA: tl.constexpr,
    W_KMAJOR: tl.constexpr, FAST_ACT: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr, GROUPS: tl.constexpr,
    BAND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    total = gg.num_row_tiles(offsets_ptr, E, LK, I, BLOCK_M, BLOCK_N, GROUPS)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        e, row0, rows, rmask, n0, _, _ = gg.row_tile(tile, offsets_ptr, E, LK, I, BLOCK_M, BLOCK_N, GROUPS, BAND)
        n_idx = n0 // BLOCK_N  # the router partial this tile writes
        real = rmask & ((rows * 0 + e) < E)  # rows of a real expert (not the sentinel group)
        tok = tl.load(eti_ptr + rows, mask=real, other=0).to(tl.int64)
        g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # dL/da / w: grad_out[token] @ W_e
        if e < E:
            for k0 in range(0, D, BLOCK_K):
                a = gg.load_rows(go_ptr, tok, real, k0, D, stride_gm, 1, BLOCK_K)
                b = gg.load_weight_tile(w_src, e, k0, n0, stride_we, stride_wk, stride_wn, D, I, W_TMA, W_KMAJOR,
                                        BLOCK_K, BLOCK_N)
                g = tl.dot(a, b, g, input_precision=PRECISION)
        w = row_combine_weights(tw_ptr, tim_ptr, tok, rows, real, stride_tw0, stride_tw1, K)[:, None]
        # The epilogue in EPILOGUE_SPLIT column slices, one after the other: a slice's h
        # tiles and activation temporaries are all that is live, which is what spills at
        # 128 x 128 in one piece.
        SLICE: tl.constexpr = BLOCK_N // EPILOGUE_SPLIT
        part = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for s in tl.static_range(EPILOGUE_SPLIT):
            part += _dh_epilogue(_column_slice(g, s, EPILOGUE_SPLIT, BLOCK_M, BLOCK_N), w, row0, rows, real, rmask,
                                 n0 + s * SLICE, I, h_ptr, dh_ptr, wact_ptr, stride_hm, stride_dhm, stride_wam, alpha,
                                 limit, ACT, INTERLEAVED, WRITE_WACT, FAST_ACT, BLOCK_M, SLICE)
        tl.store(part_ptr + rows.to(tl.int64) * n_parts + n_idx, part, mask=rmask)
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
def _wgrad_kernel(
    rows_ptr, gathered_ptr, row_ids_ptr, offsets_ptr, out_ptr,
    E, P, Q,
    stride_rm, stride_gm, stride_oe, stride_op, stride_oq,
    PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """out[e] = sum over expert e's rows r of A[r]^T B[row_ids[r]]: a [P, Q] block per
    expert, reducing over the expert's own rows. A is row-ordered ([L*K, P]: dH, or the
    weighted activation), B is gathered token rows ([*, Q]: x, or the output gradient)."""
    for tile in range(tl.program_id(0), gg.num_expert_tiles(E, P, Q, BLOCK_P, BLOCK_Q), tl.num_programs(0)):
        e, lo, hi, q_idx, ps, pmask, qs, qmask = gg.expert_tile(tile, offsets_ptr, P, Q, BLOCK_P, BLOCK_Q)
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
        # Every step masked: a peeled last step (unmasked main loop) differed run to run and
        # faulted on the H200 (docs/perf-notes.md).
        for r0 in range(lo, hi, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            rmask = rows < hi
            ids = tl.load(row_ids_ptr + rows, mask=rmask, other=0).to(tl.int64)
            # A^T read P-major, which the MMA takes from shared memory as it is.
            at = tl.load(rows_ptr + rows.to(tl.int64)[None, :] * stride_rm + ps[:, None],
                         mask=pmask[:, None] & rmask[None, :], other=0.0)
            b = gg.load_rows(gathered_ptr, ids, rmask, q_idx * BLOCK_Q, Q, stride_gm, 1, BLOCK_Q)
            acc = tl.dot(at, b, acc, input_precision=PRECISION)
        tl.store(out_ptr + e.to(tl.int64) * stride_oe + ps[:, None] * stride_op + qs[None, :] * stride_oq,
                 acc.to(out_ptr.dtype.element_ty), mask=pmask[:, None] & qmask[None, :])


@triton.jit
def _expert_row_sum_kernel(rows_ptr, row_ids_ptr, tw_ptr, tim_ptr, offsets_ptr, out_ptr, D, stride_rm, stride_oe,
                           stride_tw0, stride_tw1, K: tl.constexpr, GATHER: tl.constexpr, WEIGHTED: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[e] = sum over expert e's rows r of (w_r *) rows[row_ids[r] or r], in fp32 and a
    fixed order: the bias gradients. Weighted, ``row_ids`` are the rows' tokens and w_r
    their combine weights."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < hi
        src = tl.load(row_ids_ptr + rows, mask=rmask, other=0) if GATHER else rows
        v = tl.load(rows_ptr + src.to(tl.int64)[:, None] * stride_rm + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if WEIGHTED:
            v *= row_combine_weights(tw_ptr, tim_ptr, src.to(tl.int64), rows, rmask, stride_tw0, stride_tw1, K)[:, None]
        acc += v
    tl.store(out_ptr + e * stride_oe + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cmask)


# --------------------------------------------------------------------------- launchers


def launch_wgrad(rows, gathered, row_ids, offsets, grad_w_pq, *, kind):
    """grad_w_pq[e] = rows_e^T @ gathered[row_ids_e] for every expert e, with expert e's
    rows ``[offsets[e], offsets[e+1])``: ``rows`` is [L*K, P] in expert order, ``gathered``
    [*, Q] token rows, ``grad_w_pq`` an [E, P, Q] view of the weight gradient (any strides).
    ``kind`` ("wgrad_up" or "wgrad_down") picks the tile, and the Gluon kernel where
    ``config.runs_gluon`` says so and it applies."""
    E, P, Q = grad_w_pq.shape
    gluon = gg.gluon_kernels(kind, rows, 2 * rows.shape[0] * P * Q)
    if gluon is not None and gluon.applies(rows, gathered):
        gluon.launch_wgrad(rows, gathered, row_ids, offsets, grad_w_pq, settings.current().tiles.get(kind),
                           split_mma=config.wgrad_split_mma(kind))
        return
    tile = gg.tile_config(kind, rows)
    tiles = E * gg.cdiv(P, tile.block_m) * gg.cdiv(Q, tile.block_n)
    launch(
        _wgrad_kernel, (gg.num_programs(rows.device, tiles, tile.programs_per_sm),),
        rows, gathered, row_ids, offsets, grad_w_pq, E, P, Q,
        rows.stride(0), gathered.stride(0), *grad_w_pq.stride(),
        PRECISION=gg.precision(rows.dtype), BLOCK_P=tile.block_m, BLOCK_Q=tile.block_n, BLOCK_R=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def launch_expert_row_sums(rows, row_ids, offsets, out, topk_weights=None, token_index_map=None):
    """out[e] = sum over expert e's rows r of (w_r *) rows[row_ids[r] or r]: the bias
    gradients (``row_ids`` None: ``rows`` is in expert order). With ``topk_weights``,
    ``row_ids`` are the rows' tokens and w_r their combine weights."""
    E, D = out.shape
    BLOCK_R, BLOCK_D = (64, 128) if out.is_cuda else (16, 16)
    launch(
        _expert_row_sum_kernel, (E, gg.cdiv(D, BLOCK_D)),
        rows, row_ids, topk_weights, token_index_map, offsets, out, D, rows.stride(0), out.stride(0),
        *(topk_weights.stride() if topk_weights is not None else (0, 0)),
        K=topk_weights.shape[1] if topk_weights is not None else 1, GATHER=row_ids is not None,
        WEIGHTED=topk_weights is not None, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D,
    )


def _pq_view(grad_w, rows_are_outputs, transposed):
    """The weight gradient as [E, P, Q] with P the features of the row-ordered operand:
    ``rows_are_outputs`` when those are the layer's output features (dH for the up
    projection), else its input features (the activation for the down projection)."""
    kept = (not transposed) if rows_are_outputs else transposed
    return grad_w if kept else grad_w.transpose(1, 2)


def dh_tile(h, I):
    """dH's ``tl`` tile for an h like ``h`` of I intermediate columns: the tile of the kind
    ``config.dh_tile_kind`` gives ("dh_wide" for a wide layer, else "dh")."""
    return gg.tile_config(config.dh_tile_kind(I), h)


def dh_gluon_module(grad_out, h, w_down, *, act, transposed, interleaved, has_bias):
    """The kernel dH runs on for these operands: ``gluon.dh`` where
    ``config.runs_gluon`` says so and it applies, else None (``_dh_kernel``, on
    ``dh_tile``)."""
    E, d, I = linear_dims(w_down, transposed)
    gluon = gg.gluon_kernels("dh", h, 2 * h.shape[0] * d * I)
    if gluon is None or not gluon.applies(grad_out, h, w_down, transposed, acts.is_gated_code(act), interleaved,
                                          has_bias):
        return None
    return gluon


def dh_part_columns(gluon, h, I):
    """Columns of each router partial ``launch_dh`` writes per row on ``gluon`` (a
    ``dh_gluon_module`` result) for an h of I intermediate columns: the partials buffer is
    [L*K, cdiv(I, this)]."""
    return gluon.PART_COLUMNS if gluon is not None else dh_tile(h, I).block_n


def launch_dh(gluon, grad_out, h, w_down, eti, topk_weights, tim, offsets, b_down, grad_h, wact, parts, bdot, *,
              act, transposed, interleaved, alpha, limit):
    """dH (into ``grad_h``, which may be ``h``), the router partials (``parts``: [L*K,
    cdiv(I, dh_part_columns)]), and ``wact`` = w * act(h) (the down weight gradient's
    operand) unless it is None. On ``gluon``, the Gluon module ``dh_gluon_module`` picked for
    these operands (a "dh" tile in ``settings.tiles`` is then its kernel's), or where it is
    None on ``_dh_kernel``."""
    E, d, I = linear_dims(w_down, transposed)
    if gluon is not None:
        gluon.launch_dh(grad_out, h, w_down, eti, topk_weights, tim, offsets, grad_h, wact, parts, act=int(act),
                        transposed=transposed, alpha=alpha, limit=limit, tile=settings.current().tiles.get("dh"))
        return
    tile = dh_tile(h, I)
    # grad_out rows @ W_e as [d, I]: the forward's product transposed (reduction over d).
    strides = linear_strides(w_down, not transposed)
    w_src, w_tma, w_kmajor = gg.weight_operand(w_down, strides.reduction, tile, "dh", 2 * h.shape[0] * d * I)
    gg.launch_row_gemm(
        _dh_kernel, tile, h.dtype, h.device, I,
        go_ptr=grad_out, w_src=w_src, h_ptr=h, eti_ptr=eti, tw_ptr=topk_weights, tim_ptr=tim, offsets_ptr=offsets,
        bias_ptr=b_down, dh_ptr=grad_h, wact_ptr=wact, part_ptr=parts, bdot_ptr=bdot,
        LK=h.shape[0], E=E, D=d, I=I, alpha=float(alpha), limit=float(limit), n_parts=parts.shape[1],
        stride_gm=grad_out.stride(0), stride_we=strides.expert, stride_wk=strides.reduction,
        stride_wn=strides.output, stride_bias=b_down.stride(0) if b_down is not None else 0,
        stride_hm=h.stride(0), stride_dhm=grad_h.stride(0), stride_wam=wact.stride(0) if wact is not None else 0,
        stride_tw0=topk_weights.stride(0), stride_tw1=topk_weights.stride(1), K=topk_weights.shape[1],
        ACT=int(act), INTERLEAVED=interleaved, HAS_BIAS=b_down is not None, WRITE_WACT=wact is not None,
        W_TMA=w_tma, W_KMAJOR=w_kmajor, FAST_ACT=gg.fast_sigmoid(h),
        EPILOGUE_SPLIT=config.dh_epilogue_slices(tile.block_n),
    )


def expert_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                         topk_weights, b_down, activation, transposed, interleaved, alpha, limit, in_place=False,
                         need_weight_grad=True):
    """``in_place`` writes dH over ``h`` (contiguous) and returns h as grad_h: each dH tile
    overwrites only the h tile its own epilogue has just read, and the weight gradient
    reads the weighted activation the same epilogue wrote, not h. Without
    ``need_weight_grad`` the weight and bias gradients are returned empty and their
    kernels do not run."""
    L, K = topk_weights.shape
    LK = h.shape[0]
    E, _, I = linear_dims(w_down, transposed)
    grad_out = grad_out.contiguous()
    if in_place and not h.is_contiguous():
        raise ValueError("moeblaze.expert_down_backward_: argument 'h' must be contiguous (it is overwritten)")
    h = h.contiguous()
    act = activation_code(activation)
    dev = h.device
    grad_h = h if in_place else gg.empty(LK, h.shape[1], dtype=h.dtype, device=dev)
    grad_w = gg.empty(*w_down.shape, dtype=w_down.dtype, device=dev) if need_weight_grad else w_down.new_empty(0)
    has_grad_b = b_down is not None and need_weight_grad
    grad_b = gg.empty(*b_down.shape, dtype=b_down.dtype, device=dev) if has_grad_b else h.new_empty(0)
    grad_tw = gg.empty(L, K, dtype=topk_weights.dtype, device=dev)
    if LK == 0:
        grad_tw.zero_()
        if need_weight_grad:
            grad_w.zero_()
            grad_b.zero_()
        return grad_h, grad_w, grad_b, grad_tw
    # w * act(h), for the weight gradient: written by the dH epilogue (a transient, half of h).
    wact = gg.empty(LK, I, dtype=h.dtype, device=dev) if need_weight_grad else None
    gluon = dh_gluon_module(grad_out, h, w_down, act=act, transposed=transposed, interleaved=interleaved,
                            has_bias=b_down is not None)
    n_parts = max(1, gg.cdiv(I, dh_part_columns(gluon, h, I)))
    parts = torch.empty(LK, n_parts, dtype=torch.float32, device=dev)
    bdot = torch.empty(LK, dtype=torch.float32, device=dev)
    launch_dh(gluon, grad_out, h, w_down, expert_token_indices, topk_weights, token_index_map, expert_offsets, b_down,
              grad_h, wact, parts, bdot, act=act, transposed=transposed, interleaved=interleaved, alpha=alpha,
              limit=limit)
    BLOCK = 256
    launch(
        _router_grad_kernel, (gg.cdiv(LK, BLOCK),),
        parts, bdot, token_index_map, expert_offsets, grad_tw, LK, E, K, n_parts,
        grad_tw.stride(0), grad_tw.stride(1), HAS_BIAS=b_down is not None, BLOCK=BLOCK,
    )
    if need_weight_grad:
        # dW_down[e] = sum over its rows of (w * act(h))^T grad_out[token]; dB_down[e] = sum of w * grad_out[token].
        launch_wgrad(wact, grad_out, expert_token_indices, expert_offsets,
                     _pq_view(grad_w, rows_are_outputs=False, transposed=transposed), kind="wgrad_down")
        if has_grad_b:
            launch_expert_row_sums(grad_out, expert_token_indices, expert_offsets, grad_b, topk_weights,
                                   token_index_map)
    return grad_h, grad_w, grad_b, grad_tw


def expert_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                       has_bias, transposed, need_input_grad=True, need_weight_grad=True):
    LK, N = grad_h.shape
    E = w_gate_up.shape[0]
    L, d = x.shape
    dev = x.device
    grad_h = grad_h.contiguous()
    grad_x = gg.empty(L, d, dtype=x.dtype, device=dev) if need_input_grad else x.new_empty(0)
    if need_input_grad:
        # Each token's K rows of dH @ W_e^T (the up product transposed: reduction over N),
        # summed in order with unit weights.
        def dx_rows(rows, c0, c1):
            w = in_feature_slice(w_gate_up, c0, c1, transposed)
            launch_gathered_gemm(grad_h, None, w, None, expert_offsets, rows, not transposed, "dx")

        combine_in_slabs(dx_rows, LK, x.dtype, token_index_map, None, expert_offsets, grad_x, E,
                         widest_slab("dx", LK, N, w_gate_up.numel()))
    # The weight gradient is allocated only now: its [E, N, d] and the dX rows' [L*K, slab]
    # scratch are never alive at once.
    grad_w = gg.empty(*w_gate_up.shape, dtype=w_gate_up.dtype, device=dev) if need_weight_grad else x.new_empty(0)
    grad_b = gg.empty(E, N, dtype=x.dtype, device=dev) if has_bias and need_weight_grad else x.new_empty(0)
    if need_weight_grad:
        launch_wgrad(grad_h, x.contiguous(), expert_token_indices, expert_offsets,
                     _pq_view(grad_w, rows_are_outputs=True, transposed=transposed), kind="wgrad_up")
        if has_bias:
            launch_expert_row_sums(grad_h, None, expert_offsets, grad_b)
    return grad_x, grad_w, grad_b
