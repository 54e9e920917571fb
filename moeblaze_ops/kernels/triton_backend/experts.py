"""Triton kernels of the expert forward: two grouped GEMMs on the ``grouped_gemm`` core.

- ``_gathered_gemm_kernel``: out[r] = A[row r] @ B_e (+ bias_e) for the rows of each
  expert e. The up projection gathers its A rows (token rows of x, through
  ``expert_token_indices``) inside the operand load: no [L*K, d] copy exists. The input
  gradient reuses it on dH rows, which are already in expert order (no gather).
- The down projection, y[r] = act(h[r]) @ W_e (+ b_e): ``_activation_kernel`` writes
  a = act(h) once (a transient [L*K, I], half of h), and the gathered GEMM above runs on
  it without a gather, every operand from memory (faster than activating the A tiles in
  the GEMM as they load: see docs/performance.md). Where no h
  is needed after the forward, the up projection writes act(h) instead of h
  (``expert_up_activated``); where ``config.activation_beside_h`` holds, beside it
  (``expert_up_with_activation``). The rows are then combined per token (``combine``).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from ... import settings
from ...activations import activation_code, is_gated
from ...layouts import linear_dims, linear_strides, out_feature_slice
from .. import config
from . import grouped_gemm as gg
from ..launch import launch
from .activations import NUM_GATED, activate, is_gated_code
from .combine import combine_in_slabs, widest_slab


@triton.jit
def gathered_gemm_tile(
    tile, a_ptr, b_src, bias_ptr, a_row_ids_ptr, offsets_ptr, LK, E, N, REDUCTION,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_bias,
    GATHER_A: tl.constexpr, HAS_BIAS: tl.constexpr, B_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
    GROUPS: tl.constexpr, BAND: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(rows, row mask, columns, column mask, fp32 tile) of output tile ``tile`` of
    out[r] = A[a_row_ids[r] if GATHER_A else r] @ B_e (+ bias_e), B read as [E, REDUCTION, N];
    the sentinel group's tiles are zero. The eager kernel and the Inductor template store it."""
    e, row0, rows, rmask, n0, cols, cmask = gg.row_tile(tile, offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS, BAND)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if e < E:
        a_rows = gg.a_rows_of(a_row_ids_ptr, rows, rmask, GATHER_A)
        for k0 in range(0, REDUCTION, BLOCK_K):
            a = gg.load_rows(a_ptr, a_rows, rmask, k0, REDUCTION, stride_am, stride_ak, BLOCK_K)
            b = gg.load_weight_tile(b_src, e, k0, n0, stride_be, stride_bk, stride_bn, REDUCTION, N, B_TMA,
                                    B_KMAJOR, BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc = gg.add_bias(acc, bias_ptr, e, stride_bias, cols, cmask)
    return rows, rmask, cols, cmask, acc


@triton.jit
def _gathered_gemm_kernel(
    a_ptr, b_src, bias_ptr, a_row_ids_ptr, offsets_ptr, out_ptr,
    LK, E, N, REDUCTION,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_bias, stride_om,
    GATHER_A: tl.constexpr, HAS_BIAS: tl.constexpr, B_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
    GROUPS: tl.constexpr, BAND: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Row r of A is ``a_row_ids[r]`` with GATHER_A, else r; B is [E, REDUCTION, N]."""
    total = gg.num_row_tiles(offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        rows, rmask, cols, cmask, acc = gathered_gemm_tile(
            tile, a_ptr, b_src, bias_ptr, a_row_ids_ptr, offsets_ptr, LK, E, N, REDUCTION, stride_am, stride_ak,
            stride_be, stride_bk, stride_bn, stride_bias, GATHER_A, HAS_BIAS, B_TMA, B_KMAJOR, GROUPS, BAND,
            PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        gg.store_tile(out_ptr, rows, cols, stride_om, acc, rmask[:, None] & cmask[None, :])


@triton.jit
def activated_gemm_tile(
    tile, a_ptr, b_ptr, bias_ptr, a_row_ids_ptr, offsets_ptr, LK, E, I, REDUCTION,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_bias, alpha, limit,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, FAST_ACT: tl.constexpr, GATHER_A: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, BAND: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(rows, row mask, columns, column mask, fp32 tile) of output tile ``tile`` of
    a[r] = act(A[a_row_ids[r] or r] @ B_e + bias_e), over the I activation columns: the
    up projection with its activation in the epilogue, h never stored. A gated activation's
    tile multiplies A by the B columns of its gate and of its up halves (I columns apart,
    or side by side with INTERLEAVED) into two accumulators. B is read by pointer
    [E, REDUCTION, 2I or I]; the sentinel group's tiles are act(0) = 0."""
    e, row0, rows, rmask, n0, cols, cmask = gg.row_tile(tile, offsets_ptr, E, LK, I, BLOCK_M, BLOCK_N, GROUPS, BAND)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Activation column j reads B column j * STEP (gate) and up_col + j * STEP (up); a plain
    # activation's h has no halves to interleave.
    GATED: tl.constexpr = ACT < NUM_GATED
    STEP: tl.constexpr = 2 if INTERLEAVED and GATED else 1
    up_col = 1 if INTERLEAVED else I
    if e < E:
        a_rows = gg.a_rows_of(a_row_ids_ptr, rows, rmask, GATHER_A)
        for k0 in range(0, REDUCTION, BLOCK_K):
            a = gg.load_rows(a_ptr, a_rows, rmask, k0, REDUCTION, stride_am, stride_ak, BLOCK_K)
            b = gg.load_weight_tile(b_ptr, e, k0, n0, stride_be, stride_bk, stride_bn * STEP, REDUCTION, I, False,
                                    False, BLOCK_K, BLOCK_N)
            gate = tl.dot(a, b, gate, input_precision=PRECISION)
            if GATED:
                b = gg.load_weight_tile(b_ptr + up_col * stride_bn, e, k0, n0, stride_be, stride_bk, stride_bn * STEP,
                                        REDUCTION, I, False, False, BLOCK_K, BLOCK_N)
                up = tl.dot(a, b, up, input_precision=PRECISION)
        if HAS_BIAS:
            gate = gg.add_bias(gate, bias_ptr, e, stride_bias, cols * STEP, cmask)
            if GATED:
                up = gg.add_bias(up, bias_ptr + up_col, e, stride_bias, cols * STEP, cmask)
    return rows, rmask, cols, cmask, activate(gate, up, alpha, limit, ACT, FAST_ACT)


@triton.jit
def _activated_gemm_kernel(
    a_ptr, b_ptr, bias_ptr, a_row_ids_ptr, offsets_ptr, out_ptr,
    LK, E, I, REDUCTION,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_bias, stride_om, alpha, limit,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, FAST_ACT: tl.constexpr, GATHER_A: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, BAND: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out = act(A @ B_e + bias_e) over every routed row (``activated_gemm_tile``)."""
    total = gg.num_row_tiles(offsets_ptr, E, LK, I, BLOCK_M, BLOCK_N, GROUPS)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        rows, rmask, cols, cmask, acc = activated_gemm_tile(
            tile, a_ptr, b_ptr, bias_ptr, a_row_ids_ptr, offsets_ptr, LK, E, I, REDUCTION, stride_am, stride_ak,
            stride_be, stride_bk, stride_bn, stride_bias, alpha, limit, ACT, INTERLEAVED, FAST_ACT, GATHER_A,
            HAS_BIAS, GROUPS, BAND, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        gg.store_tile(out_ptr, rows, cols, stride_om, acc, rmask[:, None] & cmask[None, :])


#: The activation pass's tile on CUDA (rows, activation columns), the eager kernel's and the
#: Inductor template's.
ACTIVATION_TILE = (64, 128)


@triton.jit
def _activation_kernel(h_ptr, a_ptr, LK, I, alpha, limit, stride_hm, stride_am,
                       ACT: tl.constexpr, INTERLEAVED: tl.constexpr, FAST_ACT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """a = act(h) for every routed row: the down GEMM's A operand, written once."""
    row0 = tl.program_id(0) * BLOCK_M
    k0 = tl.program_id(1) * BLOCK_K
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = k0 + tl.arange(0, BLOCK_K)
    rmask = rows < LK
    g, u = gg.load_h_pair(h_ptr, row0, rmask, stride_hm, k0, I, ACT, INTERLEAVED, BLOCK_M, BLOCK_K)
    gg.store_tile(a_ptr, rows, cols, stride_am, activate(g, u, alpha, limit, ACT, FAST_ACT),
                  rmask[:, None] & (cols < I)[None, :])


# --------------------------------------------------------------------------- launchers


def launch_gathered_gemm(a, a_row_ids, b, bias, offsets, out, transposed, kind):
    """out[r] = A[a_row_ids[r] or r] @ B_e (+ bias_e) over every routed row, with B an
    expert weight stack in ``transposed`` layout read as [E, in, out] (``layouts``);
    ``kind`` picks the tile, whether B comes through TMA, and the Gluon kernel where
    ``config.runs_gluon`` says so and it applies."""
    E, _, reduction = linear_dims(b, transposed)
    flop = 2 * out.numel() * reduction
    gluon = gg.gluon_kernels(kind, a, flop)
    if gluon is not None and gluon.applies(a, b, out, transposed):
        _launch_on_gluon(gluon, kind, a, a_row_ids, b, bias, offsets, out, transposed)
        return
    LK, N = out.shape
    tile = gg.tile_config(kind, a, LK, E)
    strides = linear_strides(b, transposed)
    b_src, b_tma, b_kmajor = gg.weight_operand(b, strides.reduction, tile, kind, flop)
    gg.launch_row_gemm(
        _gathered_gemm_kernel, tile, a.dtype, a.device, N,
        a_ptr=a, b_src=b_src, bias_ptr=bias, a_row_ids_ptr=a_row_ids, offsets_ptr=offsets, out_ptr=out,
        LK=LK, E=E, N=N, REDUCTION=reduction, stride_am=a.stride(0), stride_ak=a.stride(1),
        stride_be=strides.expert, stride_bk=strides.reduction, stride_bn=strides.output,
        stride_bias=bias.stride(0) if bias is not None else 0, stride_om=out.stride(0),
        GATHER_A=a_row_ids is not None, HAS_BIAS=bias is not None, B_TMA=b_tma, B_KMAJOR=b_kmajor,
    )


def activated_tile(up_tile, act):
    """``_activated_gemm_kernel``'s tile from the up GEMM's: for a gated ``act`` half as
    many (activation) columns, each reading two of the weight's, so that a tile reads as
    many weight columns as the plain GEMM's."""
    return dataclasses.replace(up_tile, block_n=max(16, up_tile.block_n // 2)) if is_gated_code(act) else up_tile


def launch_activated_gemm(a, a_row_ids, b, bias, offsets, out, transposed, act, interleaved, alpha, limit):
    """out = act(A[a_row_ids[r]] @ B_e + bias_e) over every routed row in one ``tl`` GEMM
    (``_activated_gemm_kernel``, its tile ``activated_tile``), B the up projection's weight
    stack in ``transposed`` layout; ``act`` an ``ActivationCode``."""
    E, _, reduction = linear_dims(b, transposed)
    LK, I = out.shape
    tile = activated_tile(gg.tile_config("up", a, LK, E), act)
    strides = linear_strides(b, transposed)
    gg.launch_row_gemm(
        _activated_gemm_kernel, tile, a.dtype, a.device, I,
        a_ptr=a, b_ptr=b, bias_ptr=bias, a_row_ids_ptr=a_row_ids, offsets_ptr=offsets, out_ptr=out,
        LK=LK, E=E, I=I, REDUCTION=reduction, stride_am=a.stride(0), stride_ak=a.stride(1),
        stride_be=strides.expert, stride_bk=strides.reduction, stride_bn=strides.output,
        stride_bias=bias.stride(0) if bias is not None else 0, stride_om=out.stride(0), alpha=float(alpha),
        limit=float(limit), ACT=int(act), INTERLEAVED=interleaved, FAST_ACT=gg.fast_sigmoid(out),
        GATHER_A=a_row_ids is not None, HAS_BIAS=bias is not None,
    )


def _gluon_tile(gluon, kind):
    """The tile of GEMM ``kind`` on the Gluon row GEMM module ``gluon``: ``settings.tiles``'
    override, else the kernel's own."""
    return settings.current().tiles.get(kind, gluon.TILE)


def _launch_on_gluon(gluon, kind, a, a_row_ids, b, bias, offsets, out, transposed, epilogue=None, h=None):
    """``gluon.launch_row_gemm`` in the variant the rules pick for GEMM ``kind``: its tile,
    warp-specialised by rows per expert (``config.row_gemm_warp_specialized``). With an
    ``epilogue`` (``gluon.row_gemm.GatedEpilogue``) ``out`` is act(h), and ``h``, where
    given, receives h beside it."""
    E = linear_dims(b, transposed)[0]
    gluon.launch_row_gemm(a, a_row_ids, b, bias, offsets, out, transposed, _gluon_tile(gluon, kind),
                          config.row_gemm_warp_specialized(out.shape[0], E), epilogue=epilogue, h=h)


def launch_activation(h, a, act, interleaved, alpha, limit):
    """a = act(h) for every routed row (``_activation_kernel``): the activation pass, the
    down GEMM's A operand written once. ``act`` is an ``ActivationCode``."""
    LK, I = a.shape
    if LK == 0:
        return
    BLOCK_M, BLOCK_K = ACTIVATION_TILE if h.is_cuda else (16, 16)
    launch(
        _activation_kernel, (gg.cdiv(LK, BLOCK_M), gg.cdiv(I, BLOCK_K)),
        h, a, LK, I, float(alpha), float(limit), h.stride(0), a.stride(0), ACT=int(act),
        INTERLEAVED=interleaved, FAST_ACT=gg.fast_sigmoid(a), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)


def expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed):
    _, N, _ = linear_dims(w_gate_up, transposed)
    h = gg.empty(expert_token_indices.shape[0], N, dtype=x.dtype, device=x.device)
    if h.numel() == 0:
        return h
    launch_gathered_gemm(x, expert_token_indices, w_gate_up, b_gate_up, expert_offsets, h, transposed, "up")
    return h


def expert_up_activated(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed,
                        activation, interleaved, alpha, limit):
    """act(h) ([L*K, I] for a gated activation) of ``expert_up``'s rows, for
    ``expert_down_activated``, h never stored: in one Gluon GEMM whose epilogue pairs each
    tile's gate and up columns, where that applies (``gluon.row_gemm.applies_gated_epilogue``),
    else in the ``tl`` GEMM with the activation in its epilogue where
    ``config.activates_in_up_epilogue`` says so, else the GEMM then the activation pass."""
    _, N, reduction = linear_dims(w_gate_up, transposed)
    act = activation_code(activation)
    LK = expert_token_indices.shape[0]
    a = gg.empty(LK, N // 2 if is_gated_code(act) else N, dtype=x.dtype, device=x.device)
    if LK == 0:
        return a
    if _launch_gated_epilogue(x, w_gate_up, b_gate_up, expert_token_indices, expert_offsets, a, transposed, act,
                              interleaved, alpha, limit):
        return a
    if config.activates_in_up_epilogue(2 * LK * N * reduction):
        launch_activated_gemm(x, expert_token_indices, w_gate_up, b_gate_up, expert_offsets, a, transposed, act,
                              interleaved, alpha, limit)
        return a
    h = expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed)
    launch_activation(h, a, act, interleaved, alpha, limit)
    return a


def _launch_gated_epilogue(x, w_gate_up, b_gate_up, expert_token_indices, expert_offsets, a, transposed, act,
                           interleaved, alpha, limit, h=None) -> bool:
    """The up GEMM on Gluon with the activation ``act`` in its epilogue (act(h) into ``a``,
    h into ``h`` where given), where that applies (``gluon.row_gemm.applies_gated_epilogue``);
    returns whether it launched."""
    _, N, K = linear_dims(w_gate_up, transposed)
    gluon = gg.gluon_kernels("up", x, 2 * a.shape[0] * N * K)
    if gluon is None or not gluon.applies_gated_epilogue(x, w_gate_up, b_gate_up, a, transposed, int(act),
                                                         interleaved, _gluon_tile(gluon, "up"), h=h):
        return False
    _launch_on_gluon(gluon, "up", x, expert_token_indices, w_gate_up, None, expert_offsets, a, transposed,
                     gluon.GatedEpilogue(int(act), float(alpha), float(limit)), h=h)
    return True


def expert_up_with_activation(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up,
                              transposed, activation, interleaved, alpha, limit):
    """``(h, a)``: ``expert_up``'s h and ``a = act(h)`` ([L*K, I] for a gated activation),
    for ``expert_down_activated``: both from the Gluon up GEMM's gated epilogue where it
    applies, else the GEMM then the activation pass. (Whether a layer takes this route is
    the caller's rule, ``config.activation_beside_h``.)"""
    act = activation_code(activation)
    LK = expert_token_indices.shape[0]
    _, N, _ = linear_dims(w_gate_up, transposed)
    gated = is_gated_code(act)
    h = gg.empty(LK, N, dtype=x.dtype, device=x.device)
    a = gg.empty(LK, N // 2 if gated else N, dtype=x.dtype, device=x.device)
    if LK == 0:
        return h, a
    if gated and _launch_gated_epilogue(x, w_gate_up, b_gate_up, expert_token_indices, expert_offsets, a, transposed,
                                        act, interleaved, alpha, limit, h=h):
        return h, a
    launch_gathered_gemm(x, expert_token_indices, w_gate_up, b_gate_up, expert_offsets, h, transposed, "up")
    launch_activation(h, a, act, interleaved, alpha, limit)
    return h, a


def expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
                activation, transposed, interleaved, alpha, limit):
    """The down projection of h and the combine: act(h) written once by the activation
    pass, then ``expert_down_activated``."""
    act = activation_code(activation)
    if h.stride(1) != 1:
        h = h.contiguous()
    _, _, I = linear_dims(w_down, transposed)
    a = gg.empty(h.shape[0], I, dtype=h.dtype, device=h.device)
    launch_activation(h, a, act, interleaved, alpha, limit)
    return expert_down_activated(a, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                                 b_down, transposed, gated=is_gated(activation))


def expert_down_activated(a, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
                          transposed, gated=False, backward_follows=True):
    """``expert_down`` of rows activated already (act(h), from ``expert_up_activated`` or
    the activation pass): a plain grouped GEMM and the combine, in the column slabs
    ``widest_slab`` allows (``gated``: act(h) came from a gated activation, whose up
    weights are twice the down ones; ``backward_follows``: in training)."""
    L = topk_weights.shape[0]
    E, d, _ = linear_dims(w_down, transposed)
    out = gg.empty(L, d, dtype=a.dtype, device=a.device)

    def expert_outputs(y, c0, c1):  # columns [c0, c1) of every routed row's output; sentinel rows zero
        w = out_feature_slice(w_down, c0, c1, transposed)
        b = b_down[:, c0:c1] if b_down is not None else None
        launch_gathered_gemm(a, None, w, b, expert_offsets, y, transposed, "down")

    widest = widest_slab("down", a.shape[0], a.shape[1], w_down.numel(), gated, backward_follows)
    return combine_in_slabs(expert_outputs, a.shape[0], a.dtype, token_index_map, topk_weights, expert_offsets, out, E,
                            widest)
