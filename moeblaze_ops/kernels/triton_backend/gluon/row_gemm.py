"""The row-tiled grouped GEMM on Hopper (sm_90), in Gluon: an asynchronous pipeline ``tl`` cannot build.

``out[r] = A[a_row_ids[r] or r] @ B_e (+ bias_e)`` for every routed row r, expert e owning
rows ``[offsets[e], offsets[e+1])``, the rows past ``offsets[E]`` (sentinels) written as
zeros: the product of ``experts._gathered_gemm_kernel`` (the portable path), on the
same persistent schedule (``grouped_gemm.row_tile``'s tile numbering, the offsets read on
the device). Each reduction step of an output tile loads A [BLOCK_M, BLOCK_K] by cp.async
(16 bytes per thread, rows gathered through ``a_row_ids``, rows past the expert's end and
columns past K zero-filled) and B by TMA from a 3-D descriptor of the weight stack (the copy
engine zero-fills past the expert's own K and N edges) into a ring of ``NUM_STAGES``
shared-memory slots, while the tensor cores run the previous steps' asynchronous
``warpgroup_mma``. The copies run ahead across tile boundaries: the next tile's first steps
land while this tile's epilogue stores.

From ``config.WARP_SPECIALIZE_MIN_ROWS`` routed rows per expert
(``config.row_gemm_warp_specialized``), ``_row_gemm_ws_kernel`` runs instead: copy warps
fill the ring (A by TMA from a 2-D descriptor at the tile's first row where its rows are
in expert order, by a warpgroup's cp.async where they are gathered; B by TMA) and the MMA
warpgroups only wait, multiply and store.

Either kernel stores a tile whose rows are all inside its expert through shared memory by
TMA: the copy runs on while the warps start the next tile, where stores from registers
would hold them up. A tile that ends past its expert's rows is stored from registers,
masked: a TMA copy cannot stop at an expert's last row.

With a ``GatedEpilogue`` (the up projection without h) each tile pairs gate columns with
the same up columns, and the epilogue writes act(h) in place of h: the output is then
[L*K, N / 2] (``_store_activated_tile``).

Applies to 16-bit CUDA tensors on capability 9 whose K, N and row strides are multiples of
16 elements (the 16-byte copies must not straddle a mask edge) and whose weight TMA can
read (one of K, N contiguous, the other strides 16-byte aligned); everything else takes
the portable kernel.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ....layouts import linear_dims, linear_strides
from ... import config
from .. import grouped_gemm as gg
from .. import activations as acts
from .common import (async_load, banded, column_halves, copy_layout, copy_tma_ring, cta_barrier, host_descriptor,
                           on_hopper, output_buffer, reinterpret_shared, row_offsets_fit_32, slot_barriers,
                           store_by_tma, store_tile_by_tma, tma_load, tma_slot_shape, wgmma_acc_layout)
from ...config import GemmTile
from ...launch import launch

#: The tile: 128 x 256 outputs per program (2 warpgroups of 64 rows each), 64 of K per
#: step, 4 slots of 48 KB (2 steps in flight ahead of the MMA).
TILE = GemmTile(128, 256, 64, 8, 4)
#: (warps, registers per thread) of the warp-specialised kernel's copy warps: one warp
#: issuing TMA copies, or a warpgroup whose threads each copy 16-byte pieces of gathered
#: rows (and hold their offsets); the MMA warpgroups get the rest of the register file.
PRODUCER_TMA = (1, 40)
PRODUCER_GATHER = (4, 88)


class GatedEpilogue(NamedTuple):
    """A gated activation applied in the row GEMM's epilogue (``launch_row_gemm``): the
    GEMM's N = 2I columns are h's gate columns then its up columns (the concatenated
    layout), every output tile pairs BLOCK_N / 2 gate columns with the same up columns,
    and the output is ``act(gate, up)`` ([L*K, I]); h is never stored."""

    #: A gated ``activations.ActivationCode``.
    activation: int
    alpha: float
    limit: float


@gluon.constexpr_function
def _vector_layout(num_warps):
    """A 1-D vector spread over every thread."""
    return gl.BlockedLayout([1], [32], [num_warps], [0])


@gluon.constexpr_function
def _groups_layout(groups, num_warps):
    """A [GROUPS] vector whole in every warp: the schedule's reductions need no barrier."""
    return gl.BlockedLayout([max(1, groups // 32)], [32], [num_warps], [0])


# Combine functions of the schedule's scan and reductions: ``gl.sum`` and ``gl.max`` wrap
# ``tl`` functions, which do not compile under TRITON_INTERPRET=1 (set on CPU test machines).
@gluon.jit
def _add(x, y):
    return x + y


@gluon.jit
def _max(x, y):
    return gl.maximum(x, y)


@gluon.jit
def _tile_ends(offsets_ptr, E, LK, BLOCK_M: gl.constexpr, GROUPS: gl.constexpr, num_warps: gl.constexpr):
    """How many m-tiles end at or before the end of each group (the E experts, then group E
    holding the sentinels): ``grouped_gemm.group_bounds`` and the cumulative counts of
    ``grouped_gemm.row_tile``, computed once per program."""
    g = gl.arange(0, GROUPS, layout=_groups_layout(GROUPS, num_warps))
    lo = gl.load(offsets_ptr + g, mask=g <= E, other=0)
    hi = gl.where(g == E, LK, gl.load(offsets_ptr + g + 1, mask=g < E, other=0))
    return gl.associative_scan(gl.cdiv(hi - lo, BLOCK_M), 0, _add)


@gluon.jit
def _schedule(offsets_ptr, E, LK, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              GROUPS: gl.constexpr, num_warps: gl.constexpr):
    """(``_tile_ends``, n-tiles, reduction steps per tile, output tiles) of a program's
    schedule, which each partition of a kernel computes for itself."""
    tile_end = _tile_ends(offsets_ptr, E, LK, BLOCK_M, GROUPS, num_warps)
    n_tiles = gl.cdiv(N, BLOCK_N)
    return tile_end, n_tiles, gl.cdiv(K, BLOCK_K), gl.reduce(tile_end, 0, _max) * n_tiles


@gluon.jit
def _min(x, y):
    return gl.minimum(x, y)


@gluon.jit
def _row_tile(tile, offsets_ptr, tile_end, E, LK, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BAND: gl.constexpr):
    """(group, first row, end of the group's rows, first column) of output tile ``tile``,
    numbered as ``grouped_gemm.row_tile`` numbers them (each group's tiles together, its
    m-tiles in bands of ``BAND`` with the n-tiles); a tile past the last is in no group
    (a group number past E)."""
    before = tile_end * n_tiles <= tile  # the groups whose tiles all come before this one
    grp = gl.reduce(before.to(gl.int32), 0, _add)
    first_tile = gl.reduce(gl.where(before, tile_end, 0), 0, _max)
    end_tile = gl.reduce(gl.where(before, gl.reduce(tile_end, 0, _max), tile_end), 0, _min)
    m, n = banded(tile - first_tile * n_tiles, end_tile - first_tile, n_tiles, BAND)
    lo = gl.load(offsets_ptr + gl.minimum(grp, E))
    hi = gl.where(grp < E, gl.load(offsets_ptr + grp + 1, mask=grp < E, other=0), LK)
    return grp, lo + m * BLOCK_M, hi, n * BLOCK_N


@gluon.jit
def _row_offsets(a_row_ids_ptr, row0, row_end, stride_am, GATHER_A: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_K: gl.constexpr, num_warps: gl.constexpr):
    """Element offsets in A of a tile's rows (0 past the group's end), laid out as the A copy needs them."""
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout(BLOCK_K, num_warps)))
    if GATHER_A:
        ids = gl.load(a_row_ids_ptr + rows, mask=rows < row_end, other=0)
    else:
        ids = gl.where(rows < row_end, rows, 0)
    return ids.to(gl.int64) * stride_am


@gluon.jit
def _copy_weight_tile(b_desc, bar, b_slot, grp, n0, k0, N, B_KMAJOR: gl.constexpr, PAIRED: gl.constexpr = False):
    """Start the TMA copy of expert ``grp``'s B tile at reduction ``k0``, column ``n0`` into
    ``b_slot``, its bytes expected on ``bar`` (a 3-D descriptor: [E, N, K] when K is
    contiguous, else [E, K, N]). ``PAIRED`` (K contiguous, the box half a tile): output tile
    ``n0`` of the N = 2I gate-and-up columns takes gate columns ``n0 / 2 ..`` into the
    slot's first half and the same up columns (``I + n0 / 2 ..``) into its second."""
    if PAIRED:
        half: gl.constexpr = b_desc.block_type.shape[1]
        mbarrier.expect(bar, 2 * b_desc.block_type.nbytes)
        tma_load(b_desc, [grp, n0 // 2, k0], bar, b_slot.slice(0, half, dim=1))
        tma_load(b_desc, [grp, N // 2 + n0 // 2, k0], bar, b_slot.slice(half, half, dim=1))
    else:
        mbarrier.expect(bar, b_desc.block_type.nbytes)
        if B_KMAJOR:
            tma_load(b_desc, [grp, n0, k0], bar, b_slot)
        else:
            tma_load(b_desc, [grp, k0, n0], bar, b_slot)


@gluon.jit
def _load_bias(bias_ptr, grp, n0, N, stride_bias, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Expert ``grp``'s bias over the tile's columns. Loaded before the K loop, a column or
    so per thread, and added after it: loaded in the accumulator's layout, every thread
    would hold BLOCK_N / 4 of them and their addresses while the whole accumulator is live."""
    cols = n0 + gl.arange(0, BLOCK_N, layout=_vector_layout(num_warps))
    return gl.load(bias_ptr + grp * stride_bias + cols, mask=cols < N, other=0.0)


@gluon.jit
def _add_bias(acc, bias):
    """The accumulator plus the bias row ``_load_bias`` loaded, in fp32."""
    return acc + gl.convert_layout(bias.to(gl.float32), gl.SliceLayout(0, acc.type.layout))[None, :]


@gluon.jit
def _b_operand(b_ring, slot, B_KMAJOR: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """Ring slot ``slot``'s B tile as the wgmma's [BLOCK_K, BLOCK_N] right operand (a
    transposed view where K is the contiguous dimension)."""
    if B_KMAJOR:
        b = b_ring.index(slot).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))
    else:
        b = b_ring.index(slot).reshape([BLOCK_K, BLOCK_N])
    return b


@gluon.jit
def _store_rows(out_ptr, acc, row0, row_end, n0, N, stride_om):
    """Stores the accumulator tile's rows inside the expert (``< row_end``) and columns
    below N."""
    layout: gl.constexpr = acc.type.layout
    rows = row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = n0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@gluon.jit
def _store_tile(out_ptr, out_desc, out_buf, acc, row0, row_end, n0, N, stride_om):
    """Stores the accumulator tile's rows inside the expert: a tile whose rows all are, by
    TMA through ``out_buf`` a column half at a time (the copies run on while the warps go on
    to the next tile; ``out_desc`` is the output as [1, LK, N]); every other tile from
    registers (``_store_rows``), since a TMA copy would also write the rows of the next
    expert's first tile."""
    if row0 + acc.shape[0] <= row_end:
        store_tile_by_tma(out_desc, out_buf, acc, 0, row0, n0, False, 2)
    else:
        _store_rows(out_ptr, acc, row0, row_end, n0, N, stride_om)


@gluon.jit
def _store_activated_tile(out_ptr, out_desc, out_buf, h_ptr, h_desc, h_buf, acc, row0, row_end, n0, N, stride_om,
                          stride_hm, alpha, limit, GATED: gl.constexpr, ACT: gl.constexpr, STORE_H: gl.constexpr,
                          H_BUF_APART: gl.constexpr, by_tma=True):
    """The epilogue of a paired tile (``_copy_weight_tile``'s ``PAIRED``): the accumulator's
    first column half is gate columns ``n0 / 2 ..`` of h, its second the same up columns
    (``N / 2 + n0 / 2 ..``); it writes ``act(gate, up)`` at columns ``n0 / 2 ..`` of the
    output ([L*K, N / 2]) and, with ``STORE_H``, both halves at their columns of h
    ([L*K, N], ``h_ptr`` / ``h_desc``). Each thread holds the gate and up values of the
    same columns, so the activation needs no data movement. Stores go as
    ``_store_tile``'s: by TMA through ``out_buf`` (one half tile at a time) where every row
    is inside the expert (and ``by_tma``), else from registers. ``H_BUF_APART``: h's up
    half goes through ``h_buf``, a buffer of its own, so that no store waits for the copy
    just started. The sigmoid is the approximate one (16-bit outputs:
    ``grouped_gemm.fast_sigmoid``).
    ``GATED`` is ``activations.gated``, passed in: a ``tl`` function a kernel names
    is one the JIT resolves on every compile, and under ``TRITON_INTERPRET=1`` Gluon cannot
    compile it."""
    gate, up = column_halves(acc)
    PENDING: gl.constexpr = 1 if H_BUF_APART else 0
    if STORE_H:  # before act(h) is made: its registers then need not live beside h's stores
        _store_half(h_ptr, h_desc, out_buf, gate, row0, row_end, n0 // 2, N, stride_hm, 0, by_tma)
        _store_half(h_ptr, h_desc, h_buf, up, row0, row_end, N // 2 + n0 // 2, N, stride_hm, PENDING, by_tma)
    # In the output's 16 bits at once: half the registers beside the accumulator's.
    a = GATED(gate, up, ACT, alpha, limit, True).to(out_ptr.dtype.element_ty)
    _store_half(out_ptr, out_desc, out_buf, a, row0, row_end, n0 // 2, N // 2, stride_om, PENDING, by_tma)


@gluon.jit
def _store_half(out_ptr, out_desc, out_buf, piece, row0, row_end, c0, N, stride_om, PENDING: gl.constexpr = 0,
                by_tma=True):
    """Stores ``piece`` (a column half of a tile) at rows ``row0 ..`` and columns ``c0 ..``
    of an output of N columns, as ``_store_tile`` stores a tile: by TMA through ``out_buf``
    (``store_by_tma``'s ``PENDING``) where every row is inside the expert and ``by_tma``,
    else from registers."""
    if by_tma and row0 + piece.shape[0] <= row_end:
        store_by_tma(out_desc, out_buf, piece, 0, row0, c0, False, PENDING)
    else:
        _store_rows(out_ptr, piece, row0, row_end, c0, N, stride_om)


@gluon.jit
def _store_output(out_ptr, out_desc, out_buf, h_ptr, h_desc, acc, row0, row_end, n0, N, stride_om, stride_hm, alpha,
                  limit, GATED: gl.constexpr, ACT: gl.constexpr, STORE_H: gl.constexpr, h_buf=None, by_tma=True):
    """A tile's epilogue: ``_store_activated_tile`` where the kernel applies activation
    ``ACT`` (a gated ``ActivationCode``, computed by ``GATED``) to paired tiles, h beside
    act(h) where ``STORE_H`` (h's up half through ``h_buf`` where given, no
    copies where not ``by_tma``); else ``_store_tile`` (``ACT`` -1, ``GATED`` None)."""
    if ACT >= 0:
        H_BUF_APART: gl.constexpr = h_buf is not None
        if H_BUF_APART:
            spare = h_buf
        else:
            spare = out_buf
        _store_activated_tile(out_ptr, out_desc, out_buf, h_ptr, h_desc, spare, acc, row0, row_end, n0, N, stride_om,
                              stride_hm, alpha, limit, GATED, ACT, STORE_H, H_BUF_APART, by_tma)
    else:
        _store_tile(out_ptr, out_desc, out_buf, acc, row0, row_end, n0, N, stride_om)


@gluon.jit
def _produce(a_ptr, b_desc, a_row_ids_ptr, offsets_ptr, a_ring, b_ring, bars, slot, tile_end, n_tiles, k_steps,
             p_tile, p_k, p_grp, p_row0, p_end, p_n0, p_offs, LK, E, N, K, stride_am,
             GATHER_A: gl.constexpr, B_KMAJOR: gl.constexpr, PAIRED: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BAND: gl.constexpr, num_warps: gl.constexpr):
    """Starts the copies of step ``p_k`` of tile ``p_tile`` into ring slot ``slot`` and
    moves on to the next step, or to the program's next tile (its schedule and row
    offsets computed now, a step before its first copies need them). Past the last
    expert tile (the sentinel group comes last) it starts nothing."""
    if p_grp < E:
        layout: gl.constexpr = copy_layout(BLOCK_K, num_warps)
        rows = p_row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        ks = p_k * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
        async_load(a_ring.index(slot), a_ptr + p_offs[:, None] + ks[None, :],
                    mask=(rows < p_end)[:, None] & (ks < K)[None, :])
        _copy_weight_tile(b_desc, bars.index(slot), b_ring.index(slot), p_grp, p_n0, p_k * BLOCK_K, N, B_KMAJOR,
                          PAIRED)
        p_k += 1
        if p_k == k_steps:
            p_k = 0
            p_tile += gl.num_programs(0)
            p_grp, p_row0, p_end, p_n0 = _row_tile(p_tile, offsets_ptr, tile_end, E, LK, n_tiles, BLOCK_M, BLOCK_N,
                                                   BAND)
            p_offs = _row_offsets(a_row_ids_ptr, p_row0, p_end, stride_am, GATHER_A, BLOCK_M, BLOCK_K, num_warps)
    return p_tile, p_k, p_grp, p_row0, p_end, p_n0, p_offs


@gluon.jit
def _row_gemm_kernel(
    a_ptr, b_desc, bias_ptr, a_row_ids_ptr, offsets_ptr, out_ptr, out_desc, h_ptr, h_desc,
    LK, E, N, K,
    stride_am, stride_bias, stride_om, stride_hm, alpha, limit,
    GATHER_A: gl.constexpr, HAS_BIAS: gl.constexpr, B_KMAJOR: gl.constexpr, GROUPS: gl.constexpr,
    BAND: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    NUM_STAGES: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr, STORE_H: gl.constexpr,
    num_warps: gl.constexpr,
):
    # ACT >= 0: the tiles are paired (gate and up columns, ``_copy_weight_tile``) and the
    # epilogue writes act(h), [LK, N / 2], in place of h, or beside it (to ``h_ptr``, by
    # ``h_desc``) where STORE_H (``_store_output``).
    # Ring of NUM_STAGES slots: step c in the MMA, step c - 1 possibly still in it (one
    # asynchronous wgmma stays in flight), steps c + 1 .. c + AHEAD landing.
    AHEAD: gl.constexpr = NUM_STAGES - 2
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_N, num_warps)
    a_ring, b_ring, bars = copy_tma_ring(dtype, b_desc, NUM_STAGES, BLOCK_M, BLOCK_K, 2 if ACT >= 0 else 1)
    out_buf = output_buffer(out_desc, dtype, True)

    tile_end, n_tiles, k_steps, total = _schedule(offsets_ptr, E, LK, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUPS,
                                                  num_warps)

    # The producer walks this program's tiles and their steps AHEAD steps before the MMA.
    p_tile = gl.program_id(0)
    p_k = 0
    p_grp, p_row0, p_end, p_n0 = _row_tile(p_tile, offsets_ptr, tile_end, E, LK, n_tiles, BLOCK_M, BLOCK_N, BAND)
    p_offs = _row_offsets(a_row_ids_ptr, p_row0, p_end, stride_am, GATHER_A, BLOCK_M, BLOCK_K, num_warps)
    # One commit group per step, empty when nothing is left to copy, so that "all but
    # AHEAD - 1 groups landed" always means "step c landed".
    for s in gl.static_range(AHEAD):
        p_tile, p_k, p_grp, p_row0, p_end, p_n0, p_offs = _produce(
            a_ptr, b_desc, a_row_ids_ptr, offsets_ptr, a_ring, b_ring, bars, s, tile_end, n_tiles, k_steps,
            p_tile, p_k, p_grp, p_row0, p_end, p_n0, p_offs, LK, E, N, K, stride_am,
            GATHER_A, B_KMAJOR, ACT >= 0, BLOCK_M, BLOCK_N, BLOCK_K, BAND, num_warps)
        cp.commit_group()

    step = 0  # steps consumed by this program: its ring slot and its barrier's phase
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        grp, row0, row_end, n0 = _row_tile(tile, offsets_ptr, tile_end, E, LK, n_tiles, BLOCK_M, BLOCK_N, BAND)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        if grp < E:  # sentinel tiles store zeros
            if HAS_BIAS:
                bias = _load_bias(bias_ptr, grp, n0, N, stride_bias, BLOCK_N, num_warps)
            for _ in range(k_steps):
                slot = step % NUM_STAGES
                cp.wait_group(AHEAD - 1)  # this thread's A copies of this step have landed
                fence_async_shared()  # ... and are visible to wgmma (async proxy) once every thread passes the barrier
                mbarrier.wait(bars.index(slot), (step // NUM_STAGES) & 1)
                # Every thread's copies have landed, and every warpgroup's MMA of step - 2 is
                # done (each waited for it in the step before): its slot is refilled below.
                cta_barrier()
                acc = warpgroup_mma(a_ring.index(slot), _b_operand(b_ring, slot, B_KMAJOR, BLOCK_N, BLOCK_K), acc,
                                    is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                p_tile, p_k, p_grp, p_row0, p_end, p_n0, p_offs = _produce(
                    a_ptr, b_desc, a_row_ids_ptr, offsets_ptr, a_ring, b_ring, bars, (step + AHEAD) % NUM_STAGES,
                    tile_end, n_tiles, k_steps, p_tile, p_k, p_grp, p_row0, p_end, p_n0, p_offs, LK, E, N, K,
                    stride_am, GATHER_A, B_KMAJOR, ACT >= 0, BLOCK_M, BLOCK_N, BLOCK_K, BAND, num_warps)
                cp.commit_group()
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if HAS_BIAS:
                acc = _add_bias(acc, bias)
        _store_output(out_ptr, out_desc, out_buf, h_ptr, h_desc, acc, row0, row_end, n0, N, stride_om, stride_hm,
                      alpha, limit, GATED, ACT, STORE_H)
    cp.wait_group(0)
    tma.store_wait(0)  # the last copy has read its buffer before the program's shared memory goes


# --------------------------------------------------------------------------- warp-specialised


@gluon.jit
def _ws_producer(a_src, b_desc, a_row_ids_ptr, offsets_ptr, a_ring, b_ring, a_ready, b_ready, empty, LK, E, N, K,
                 stride_am, GATHER_A: gl.constexpr, B_KMAJOR: gl.constexpr, GROUPS: gl.constexpr, BAND: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, WARPS: gl.constexpr,
                 COPY_A: gl.constexpr = True, COPY_B: gl.constexpr = True, A_OFFSETS_32: gl.constexpr = False,
                 PAIRED: gl.constexpr = False):
    """The copy warps: for every step of this program's expert tiles (the schedule of
    ``_row_tile``), wait until the MMA has released the step's ring slot, then start the
    copies of its B tile (``COPY_B``: by TMA) and its A tile (``COPY_A``: by TMA from a 2-D
    descriptor at the tile's first row, rows past the expert's end multiplied and not
    stored; or, gathered, by every copy thread's 16-byte cp.async, each thread arriving on
    the slot's ``a_ready`` once its copies have landed). Two partitions may split the
    operands, each waiting on ``empty`` on its own. ``A_OFFSETS_32``: A's element offsets
    fit in 32 bits (half the registers and instructions per gathered row). ``PAIRED``: B
    tiles of gate and up columns (``_copy_weight_tile``)."""
    NUM_STAGES: gl.constexpr = a_ring.type.shape[0]
    tile_end, n_tiles, k_steps, total = _schedule(offsets_ptr, E, LK, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUPS, WARPS)
    step = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        grp, row0, row_end, n0 = _row_tile(tile, offsets_ptr, tile_end, E, LK, n_tiles, BLOCK_M, BLOCK_N, BAND)
        if grp < E:  # the sentinel tiles copy nothing
            if COPY_A and GATHER_A:
                # The tile's row offsets and row mask, made once. These warps issue one
                # instruction after another with nothing to hide their latencies, so every
                # instruction a step saves shortens the step.
                layout: gl.constexpr = copy_layout(BLOCK_K, WARPS)
                rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
                ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
                offs = _row_offsets(a_row_ids_ptr, row0, row_end, stride_am, True, BLOCK_M, BLOCK_K, WARPS)
                if A_OFFSETS_32:
                    offs = offs.to(gl.int32)
                a_offs = offs[:, None] + ks[None, :]
                in_rows = (rows < row_end)[:, None] & (ks >= 0)[None, :]  # the copy's full [M, K] shape
            for k in range(k_steps):
                slot = step % NUM_STAGES
                # A fresh barrier has completed no phase: the first pass over the ring waits for nothing.
                mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)
                if COPY_B:  # first: its latency then runs while A's copies are issued
                    _copy_weight_tile(b_desc, b_ready.index(slot), b_ring.index(slot), grp, n0, k * BLOCK_K, N,
                                      B_KMAJOR, PAIRED)
                if COPY_A:
                    if GATHER_A:
                        if (k + 1) * BLOCK_K <= K:
                            async_load(a_ring.index(slot), a_src + (a_offs + k * BLOCK_K), mask=in_rows)
                        else:  # the last step of a K that is not a multiple of BLOCK_K
                            async_load(a_ring.index(slot), a_src + (a_offs + k * BLOCK_K),
                                       mask=in_rows & (k * BLOCK_K + ks < K)[None, :])
                        cp.mbarrier_arrive(a_ready.index(slot), increment_count=False)
                    else:
                        mbarrier.expect(a_ready.index(slot), a_src.block_type.nbytes)
                        tma_load(a_src, [row0, k * BLOCK_K], a_ready.index(slot), a_ring.index(slot))
                step += 1


@gluon.jit
def ws_tile_steps(acc, step, k_steps, a_ring, b_ring, a_ready, b_ready, empty, GATHER_A: gl.constexpr,
                  B_KMAJOR: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  ONE_READY: gl.constexpr = False, A_TRANSPOSED: gl.constexpr = False,
                  HOLD_LAST: gl.constexpr = False, A_FIRST_ROW: gl.constexpr = 0):
    """An MMA warpgroup's reduction over one output tile of a warp-specialised kernel's
    ring (``_ws_producer`` fills it): for each of the tile's ``k_steps`` steps, wait for its
    copies, run the asynchronous wgmma, and release the slot of the step before once its
    wgmma is done (one stays in flight); the last slot is released when the tile's MMAs
    are (a tile of no steps releases none). ``step`` counts the ring's steps this
    warpgroup has passed; returns (acc, step). ``ONE_READY``: both copies arrive on
    ``a_ready``; ``b_ready`` is not waited on. ``A_TRANSPOSED``: a slot of ``a_ring`` holds
    A^T ([BLOCK_K, M]), taken as a transposed view. An ``acc`` of fewer rows than the slot's
    M multiplies A's rows ``A_FIRST_ROW ..`` (the part of an MMA partition that owns them).
    ``HOLD_LAST``: the last slot is not released (the caller uses it, then releases it)."""
    NUM_STAGES: gl.constexpr = a_ring.type.shape[0]
    for k in range(k_steps):
        slot = step % NUM_STAGES
        phase = (step // NUM_STAGES) & 1
        mbarrier.wait(a_ready.index(slot), phase)
        if not ONE_READY:
            mbarrier.wait(b_ready.index(slot), phase)
        if GATHER_A:
            # cp.async wrote A through the generic proxy; wgmma reads through the async one.
            fence_async_shared()
        a = a_ring.index(slot)
        if A_TRANSPOSED:
            if acc.shape[0] < a.shape[1]:
                a = a.slice(A_FIRST_ROW, acc.shape[0], dim=1)
            a = a.permute((1, 0))
        elif acc.shape[0] < a.shape[0]:
            a = a.slice(A_FIRST_ROW, acc.shape[0], dim=0)
        acc = warpgroup_mma(a, _b_operand(b_ring, slot, B_KMAJOR, BLOCK_N, BLOCK_K), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        cta_barrier()  # every MMA warp's wgmma of the step before is done: release its slot
        mbarrier.arrive(empty.index((step + NUM_STAGES - 1) % NUM_STAGES), pred=k > 0)
        step += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    cta_barrier()
    if not HOLD_LAST:
        mbarrier.arrive(empty.index((step + NUM_STAGES - 1) % NUM_STAGES), pred=k_steps > 0)
    return acc, step


@gluon.jit
def _ws_consumer(a_ring, b_ring, a_ready, b_ready, empty, bias_ptr, offsets_ptr, out_ptr, out_desc, out_buf, h_ptr,
                 h_desc, LK, E, N, K, stride_bias, stride_om, stride_hm, alpha, limit, GATHER_A: gl.constexpr,
                 HAS_BIAS: gl.constexpr, B_KMAJOR: gl.constexpr, GROUPS: gl.constexpr, BAND: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, WARPS: gl.constexpr,
                 GATED: gl.constexpr, ACT: gl.constexpr, STORE_H: gl.constexpr):
    """MMA warps: each tile's steps (``ws_tile_steps``), then the bias and the store of the
    tile's rows inside the expert (``_store_output``). Where it writes h beside act(h) by
    TMA, h's up half goes through the B slot of the tile's last step (as big as
    ``out_buf`` where BLOCK_K is half BLOCK_M), held back from the copies until that store
    has read it: three stores then never wait for the copy just started."""
    NUM_STAGES: gl.constexpr = a_ring.type.shape[0]
    HOLD: gl.constexpr = STORE_H and 2 * BLOCK_K == BLOCK_M
    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_N, WARPS)
    tile_end, n_tiles, k_steps, total = _schedule(offsets_ptr, E, LK, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUPS,
                                                  WARPS)
    step = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        grp, row0, row_end, n0 = _row_tile(tile, offsets_ptr, tile_end, E, LK, n_tiles, BLOCK_M, BLOCK_N, BAND)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        if grp < E:  # sentinel tiles store zeros
            if HAS_BIAS:
                bias = _load_bias(bias_ptr, grp, n0, N, stride_bias, BLOCK_N, WARPS)
            acc, step = ws_tile_steps(acc, step, k_steps, a_ring, b_ring, a_ready, b_ready, empty, GATHER_A, B_KMAJOR,
                                      BLOCK_N, BLOCK_K, HOLD_LAST=HOLD)
            if HAS_BIAS:
                acc = _add_bias(acc, bias)
        if HOLD:
            held = (step + NUM_STAGES - 1) % NUM_STAGES
            h_buf = reinterpret_shared(b_ring.index(held), out_buf.dtype, out_buf.shape, out_buf.layout)
            # A sentinel tile has no step, so no slot held: it stores from registers.
            _store_output(out_ptr, out_desc, out_buf, h_ptr, h_desc, acc, row0, row_end, n0, N, stride_om,
                          stride_hm, alpha, limit, GATED, ACT, STORE_H, h_buf, grp < E)
            tma.store_wait(1)  # h's up half is read (act(h)'s copy may run on) ...
            cta_barrier()  # ... before the slot goes back to the copies
            mbarrier.arrive(empty.index(held), pred=(grp < E) & (k_steps > 0))
        else:
            _store_output(out_ptr, out_desc, out_buf, h_ptr, h_desc, acc, row0, row_end, n0, N, stride_om, stride_hm,
                          alpha, limit, GATED, ACT, STORE_H)
    tma.store_wait(0)


@gluon.jit
def _row_gemm_ws_kernel(
    a_src, b_desc, bias_ptr, a_row_ids_ptr, offsets_ptr, out_ptr, out_desc, h_ptr, h_desc,
    LK, E, N, K,
    stride_am, stride_bias, stride_om, stride_hm, alpha, limit,
    GATHER_A: gl.constexpr, HAS_BIAS: gl.constexpr, B_KMAJOR: gl.constexpr, GROUPS: gl.constexpr,
    BAND: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    NUM_STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    A_OFFSETS_32: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr, STORE_H: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``_row_gemm_kernel`` warp-specialised: ``PRODUCER_WARPS`` warps copy the A and B
    tiles into the ring (``a_src`` a TMA descriptor of A, or A's pointer when its rows are
    gathered), the MMA warps run the wgmma and the epilogue. Each ring slot has three
    mbarriers: ``a_ready`` and ``b_ready`` (its copies landed) and ``empty`` (the MMA is
    done with it)."""
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    a_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_ring = gl.allocate_shared_memory(
        dtype, [NUM_STAGES] + tma_slot_shape(b_desc.block_type.shape, 2 if ACT >= 0 else 1), b_desc.layout)
    # Gathered, every copy thread arrives on a_ready once its cp.async copies land.
    a_ready = slot_barriers(NUM_STAGES, PRODUCER_WARPS * 32 if GATHER_A else 1)
    b_ready = slot_barriers(NUM_STAGES, 1)
    empty = slot_barriers(NUM_STAGES, 1)
    out_buf = output_buffer(out_desc, dtype, True)
    # h's pointer and descriptor where the epilogue writes h beside act(h), else stand-ins
    # it never writes through: a partition's arguments cannot be None.
    if STORE_H:
        h_out = h_ptr
        h_out_desc = h_desc
    else:
        h_out = out_ptr
        h_out_desc = out_desc
    gl.warp_specialize([
        (_ws_consumer, (a_ring, b_ring, a_ready, b_ready, empty, bias_ptr, offsets_ptr, out_ptr, out_desc, out_buf,
                        h_out, h_out_desc, LK, E, N, K, stride_bias, stride_om, stride_hm, alpha, limit, GATHER_A,
                        HAS_BIAS, B_KMAJOR, GROUPS, BAND, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, GATED, ACT,
                        STORE_H)),
        (_ws_producer, (a_src, b_desc, a_row_ids_ptr, offsets_ptr, a_ring, b_ring, a_ready, b_ready, empty, LK, E, N,
                        K, stride_am, GATHER_A, B_KMAJOR, GROUPS, BAND, BLOCK_M, BLOCK_N, BLOCK_K, PRODUCER_WARPS,
                        True, True, A_OFFSETS_32, ACT >= 0)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


def _weight_view(b: torch.Tensor, transposed: bool):
    """The weight stack as TMA reads it, a view whose last dimension is contiguous: [E, N, K]
    when K is the contiguous one (``(view, True)``), else [E, K, N]; None where neither is."""
    E, N, K = linear_dims(b, transposed)
    strides = linear_strides(b, transposed)
    if strides.reduction == 1:
        return b.as_strided((E, N, K), (strides.expert, strides.output, 1)), True
    if strides.output == 1:
        return b.as_strided((E, K, N), (strides.expert, strides.reduction, 1)), False
    return None, False


def applies(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, transposed: bool) -> bool:
    """Whether ``launch_row_gemm`` handles these operands (else the portable kernel does)."""
    if not (a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype and out.dtype == a.dtype):
        return False
    if not on_hopper(a):
        return False
    _, N, K = linear_dims(b, transposed)
    view, _ = _weight_view(b, transposed)
    aligned = all(n % 16 == 0 for n in (K, N, a.stride(0), out.stride(0)))
    # TMA: every dimension non-empty, the start and the outer strides 16-byte aligned.
    weight_tma = (view is not None and view.numel() > 0 and view.data_ptr() % 16 == 0
                  and all(s * view.element_size() % 16 == 0 for s in view.stride()[:2]))
    return (aligned and weight_tma and a.stride(1) == 1 and out.stride(1) == 1
            and a.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0)


def applies_gated_epilogue(a: torch.Tensor, b: torch.Tensor, bias, out: torch.Tensor, transposed: bool,
                           activation: int, interleaved: bool, tile: GemmTile = TILE,
                           h: Optional[torch.Tensor] = None) -> bool:
    """Whether ``launch_row_gemm`` takes a ``GatedEpilogue`` for these operands, ``out``
    being act(h) [L*K, I] (and ``h``, where given, h [L*K, 2I] beside it): where it takes
    the GEMM (``applies``, for ``h`` too) and the activation is gated, the layout
    concatenated, K the weights' contiguous dimension (two half boxes a tile), no bias,
    and I a multiple of half a tile (a paired tile never reaches the other half's
    columns)."""
    _, N, _ = linear_dims(b, transposed)
    return (acts.is_gated_code(activation) and not interleaved and bias is None and N % tile.block_n == 0
            and out.shape[1] * 2 == N and _weight_view(b, transposed)[1] and applies(a, b, out, transposed)
            and (h is None or (h.shape == (out.shape[0], N) and applies(a, b, h, transposed))))


def launch_row_gemm(a, a_row_ids, b, bias, offsets, out, transposed, tile: GemmTile = TILE,
                    warp_specialize: bool = True, epilogue: Optional[GatedEpilogue] = None,
                    h: Optional[torch.Tensor] = None):
    """out[r] = A[a_row_ids[r] or r] @ B_e (+ bias_e) over every routed row, B an expert
    weight stack in ``transposed`` layout (``layouts``), as
    ``experts.launch_gathered_gemm``; ``tile`` is (M, N, K block, warps, stages)
    with M = 16 * warps; ``warp_specialize`` picks ``_row_gemm_ws_kernel``
    (``config.row_gemm_warp_specialized``). The tiles go in bands of ``config.ROW_BAND``
    m-tiles (``grouped_gemm.banded``); those whose rows are all inside their expert are
    stored by TMA (``_store_tile``). With an ``epilogue`` (where
    ``applies_gated_epilogue``) out is act(A @ B_e), half the GEMM's columns, and ``h``,
    where given, receives A @ B_e itself (all N columns) from the same epilogue."""
    if h is not None and epilogue is None:
        raise ValueError("moeblaze gluon row GEMM: h beside the output needs a gated epilogue")
    if tile.block_m != 16 * tile.num_warps or tile.num_stages < 3:
        raise ValueError(f"moeblaze gluon row GEMM: block_m must be 16 * num_warps and num_stages at least 3, "
                         f"got {tile}")
    E, N, K = linear_dims(b, transposed)
    LK = out.shape[0]
    if LK * N == 0:
        return
    view, kmajor = _weight_view(b, transposed)
    # A paired tile's weights come as two boxes of half its columns (``_copy_weight_tile``).
    box_n = tile.block_n // 2 if epilogue is not None else tile.block_n
    block = [1, box_n, tile.block_k] if kmajor else [1, tile.block_k, box_n]
    b_desc = host_descriptor(view, block)
    max_tiles = (gg.cdiv(LK, tile.block_m) + E + 1) * gg.cdiv(N, tile.block_n)
    grid = (gg.num_programs(a.device, max_tiles),)
    # Tiles are stored a column half at a time (a paired tile's act(h) is one half).
    out_box = [1, tile.block_m, tile.block_n // 2]
    out_desc = host_descriptor(out.unsqueeze(0), out_box)
    h_desc = host_descriptor(h.unsqueeze(0), out_box) if h is not None else None
    act_scalars = (float(epilogue.alpha), float(epilogue.limit)) if epilogue is not None else (0.0, 0.0)
    common = dict(HAS_BIAS=bias is not None, B_KMAJOR=kmajor, GROUPS=gg.next_power_of_2(E + 1),
                  BAND=config.ROW_BAND, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                  NUM_STAGES=tile.num_stages, GATED=acts.gated if epilogue is not None else None,
                  ACT=int(epilogue.activation) if epilogue is not None else -1, STORE_H=h is not None)
    strides = (a.stride(0), bias.stride(0) if bias is not None else 0, out.stride(0),
               h.stride(0) if h is not None else 0)
    if warp_specialize:
        gather = a_row_ids is not None
        if gather:
            a_src = a
        else:
            a_block = [tile.block_m, tile.block_k]
            a_src = host_descriptor(a, a_block)
        warps, regs = PRODUCER_GATHER if gather else PRODUCER_TMA
        launch(
            _row_gemm_ws_kernel, grid,
            a_src, b_desc, bias, a_row_ids, offsets, out, out_desc, h, h_desc, LK, E, N, K, *strides, *act_scalars,
            GATHER_A=gather, PRODUCER_WARPS=warps, PRODUCER_REGS=regs, A_OFFSETS_32=row_offsets_fit_32(a),
            num_warps=tile.num_warps, **common)
        return
    launch(
        _row_gemm_kernel, grid,
        a, b_desc, bias, a_row_ids, offsets, out, out_desc, h, h_desc, LK, E, N, K, *strides, *act_scalars,
        GATHER_A=a_row_ids is not None, num_warps=tile.num_warps, **common,
    )
