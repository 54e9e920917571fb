"""The combine: each token's K routed rows summed in a fixed order, made in column slabs.

``out[i] = sum over k = 0..K-1, in that order, of w[i, k] * rows[token_index_map[i*K + k]]``
in fp32: bitwise deterministic, no atomics. The forward sums the experts' outputs with
the router weights; the input gradient sums each token's dX rows with unit weights.

The [L*K, d] rows it sums are scratch: ``combine_in_slabs`` makes them one column slab
at a time (``settings.column_slab`` columns, wider where the layer's weight gradients
leave room: ``widest_slab``), so the scratch is [L*K, slab] and the GEMM work is the
same, in d/slab launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ... import settings
from . import grouped_gemm as gg
from ..launch import launch


#: The combine's tile on CUDA (tokens, columns), the eager kernel's and the Inductor template's.
COMBINE_TILE = (32, 128)


@triton.jit
def combine_tile(rows_ptr, tim_ptr, weights_ptr, real_rows, toks, tmask, cols, cmask, stride_rm, stride_w0,
                 stride_w1, K: tl.constexpr, WEIGHTED: tl.constexpr):
    """The fp32 [tokens, cols] tile of the combine: each token's K rows, weighted, summed
    in the order k = 0..K-1 (bitwise deterministic); rows at or past ``real_rows``
    (sentinels) add nothing."""
    acc = tl.zeros((toks.shape[0], cols.shape[0]), dtype=tl.float32)
    for k in tl.static_range(K):
        pos = tl.load(tim_ptr + toks.to(tl.int64) * K + k, mask=tmask, other=0)
        keep = tmask & (pos < real_rows)
        if WEIGHTED:
            w = tl.load(weights_ptr + toks * stride_w0 + k * stride_w1, mask=keep, other=0.0).to(tl.float32)
        else:
            w = tl.where(keep, 1.0, 0.0)
        y = tl.load(rows_ptr + pos.to(tl.int64)[:, None] * stride_rm + cols[None, :],
                    mask=keep[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += w[:, None] * y
    return acc


@triton.jit
def row_combine_weights(weights_ptr, tim_ptr, toks, rows, mask, stride_w0, stride_w1, K: tl.constexpr):
    """The combine weight of each routed row ``rows`` of tokens ``toks``, in fp32: the one of
    the token's K choices whose row (``token_index_map``) it is. Read where a kernel needs
    it, rather than scattered into an array first."""
    # Started from the first choice's load rather than tl.zeros, which needs a layout when a
    # Gluon kernel calls this (gluon.dh).
    for k in tl.static_range(K):
        row_k = tl.load(tim_ptr + toks * K + k, mask=mask, other=-1)
        w_k = tl.load(weights_ptr + toks * stride_w0 + k * stride_w1, mask=mask & (row_k == rows),
                      other=0.0).to(tl.float32)
        if k == 0:
            w = w_k
        else:
            w = tl.where(row_k == rows, w_k, w)
    return w


@triton.jit
def _combine_kernel(
    rows_ptr, tim_ptr, weights_ptr, offsets_ptr, out_ptr, L, D, E,
    stride_rm, stride_w0, stride_w1, stride_om,
    K: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = toks < L
    cmask = cols < D
    acc = combine_tile(rows_ptr, tim_ptr, weights_ptr, tl.load(offsets_ptr + E), toks, tmask, cols, cmask,
                       stride_rm, stride_w0, stride_w1, K, WEIGHTED)
    gg.store_tile(out_ptr, toks, cols, stride_om, acc, tmask[:, None] & cmask[None, :])


def combine(rows, token_index_map, topk_weights, expert_offsets, out, E):
    """out[i] = sum_k w[i, k] * rows[token_index_map[i*K + k]]; unit weights when
    ``topk_weights`` is None."""
    L, d = out.shape
    if L == 0 or d == 0:
        return out
    K = token_index_map.shape[0] // L
    BLOCK_L, BLOCK_D = COMBINE_TILE if rows.is_cuda else (16, 16)
    grid = (gg.cdiv(L, BLOCK_L), gg.cdiv(d, BLOCK_D))
    weighted = topk_weights is not None
    launch(
        _combine_kernel, grid,
        rows, token_index_map, topk_weights, expert_offsets, out, L, d, E,
        rows.stride(0), topk_weights.stride(0) if weighted else 0, topk_weights.stride(1) if weighted else 0,
        out.stride(0), K=K, BLOCK_L=BLOCK_L, BLOCK_D=BLOCK_D, WEIGHTED=weighted,
    )
    return out


def column_slabs(d: int, widest: int = 0) -> list[tuple[int, int]]:
    """The [c0, c1) column ranges the [L*K, d] scratch is made in: slabs of
    ``settings.column_slab`` columns or, where ``widest`` columns fit (``widest_slab``),
    the fewest slabs of whole multiples of it that do, each as narrow as that count allows
    (2048 columns within 1536: two of 1024, not 1536 and 512), so that the scratch is no
    wider than the launches need. Wider slabs are fewer launches for the same memory peak
    (see docs/performance.md)."""
    slab = settings.current().column_slab
    if slab and widest > slab:
        most = widest // slab * slab
        count = gg.cdiv(d, most)
        slab = gg.cdiv(gg.cdiv(d, count), slab) * slab
    step = slab if slab and slab < d else max(d, 1)
    return [(c0, min(d, c0 + step)) for c0 in range(0, d, step)]


def widest_slab(kind: str, rows: int, reduction: int, weight_numel: int, gated: bool = False,
                backward_follows: bool = True) -> int:
    """The most columns the [rows, slab] scratch of GEMM ``kind`` may take so that training
    peaks no higher than with narrow slabs: its peak is in the backward, beside the weight
    gradients. The forward's down projection (``kind`` "down", A = act(h) [rows,
    reduction], ``weight_numel`` the down weights') keeps its scratch and act(h) within
    the bytes of both weight gradients: the down weights' and the up weights', as big as
    the down ones, or twice as big where the activation is ``gated`` (gate and up
    columns). Where a ``backward_follows`` (training), the scratch may also be as big as the
    down weights: the backward's down weight gradient runs beside its own bytes and
    w * act(h)'s, as big as act(h). The backward's dX rows (``kind`` "dx",
    ``weight_numel`` the up weights') stay within the up weights' bytes: their gradient is
    made only once the scratch is gone.
    Counted in elements (the scratch has the weights' dtype); 0 where nothing fits or
    there are no rows."""
    if rows <= 0:
        return 0
    if kind == "down":
        room = (3 if gated else 2) * weight_numel - rows * reduction
        if backward_follows:
            room = max(room, weight_numel)
    else:
        room = weight_numel
    return max(0, room) // rows


def combine_in_slabs(make_rows, LK, dtype, token_index_map, topk_weights, expert_offsets, out, E, widest=0):
    """``combine`` of [L*K, d] rows made one column slab at a time (``column_slabs``, at
    most ``widest`` columns where widened): ``make_rows(rows, c0, c1)`` writes columns
    [c0, c1) of every routed row into the [L*K, c1 - c0] view ``rows`` of one scratch
    buffer, which is then summed into ``out[:, c0:c1]``."""
    slabs = column_slabs(out.shape[1], widest)
    scratch = gg.empty(LK, slabs[0][1] - slabs[0][0] if slabs else 0, dtype=dtype, device=out.device)
    for c0, c1 in slabs:
        rows = scratch[:, :c1 - c0]
        if LK > 0:
            make_rows(rows, c0, c1)
        combine(rows, token_index_map, topk_weights, expert_offsets, out[:, c0:c1], E)
    return out
