"""The weight gradients on Hopper (sm_90), in Gluon: an asynchronous pipeline ``tl`` cannot build.

``out[e] = sum over expert e's rows r of A[r]^T B[row_ids[r]]`` (the same product as
``experts_backward._wgrad_kernel``, the portable path): A row-ordered ([L*K, P]: dH,
or w * act(h)), B gathered token rows ([*, Q]: x, or the output gradient), one [P, Q]
block per expert. The reduction runs over the expert's own rows, so both operands are
loaded along it into a ring of ``NUM_STAGES`` shared-memory slots, while the tensor cores
run the previous steps' asynchronous ``warpgroup_mma``.

``_wgrad_rows_tma_ws_kernel`` is warp-specialised: a copy warpgroup fills the ring and
the MMA warpgroups only wait, multiply and store. The gathered rows are the MMA's left
operand (the 128-wide side, gathered by 16-byte cp.async copies through ``row_ids``) and
the row-ordered operand its right one (the 256-wide side), read by TMA in every step that
lies inside the expert, so two thirds of the bytes travel by the copy engine; the
expert's last, partial step stays a masked cp.async, since the next expert's rows may
hold anything and 0 * inf would reach this expert's sum. The MMA warps run the row
GEMM's step loop (``row_gemm.ws_tile_steps``) and store each tile by TMA beside the
next tile's MMAs. This is the variant that won every measured shape (see
docs/performance.md).

Applies to 16-bit CUDA tensors on capability 9 whose column counts and row strides are
multiples of 16 elements (the 16-byte copies must not straddle a mask edge); everything
else takes the portable kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .. import grouped_gemm as gg
from ... import config
from ...config import GemmTile
from .common import (async_load, copy_layout, host_descriptor, on_hopper, partition_output,
                           row_offsets_fit_32, slot_barriers, store_pieces, store_tile_by_tma, tma_load,
                           wgmma_acc_layout)
from .row_gemm import ws_tile_steps
from ...launch import launch

#: The tile: 256 P (the row-ordered operand's features, by TMA) x 128 Q (the gathered
#: rows' features: 16 rows per MMA warp) per program, 64 rows of the reduction per step,
#: 4 slots of 48 KB.
TILE = GemmTile(256, 128, 64, 8, 4)
#: (warps, registers per thread) of the copy warpgroup (its threads each copy 16-byte
#: pieces of the gathered rows and hold their row offsets).
PRODUCER = (4, 88)
#: Registers a thread of the second MMA partition where the MMA warpgroups run as two
#: (a [64, 256] accumulator and its TMA-store epilogue); the first takes what the other
#: partitions leave.
MMA_GROUP_REGS = 208


@gluon.jit
def _gathered_offsets(row_ids_ptr, r0, hi, stride_gm, OFFSETS_32: gl.constexpr, BLOCK_Q: gl.constexpr,
                      BLOCK_R: gl.constexpr, num_warps: gl.constexpr):
    """Element offsets of reduction step [r0, r0 + BLOCK_R)'s gathered rows (row 0 past
    ``hi``), laid out as the gathered copy needs them; in 32 bits where ``OFFSETS_32``
    (half the registers and instructions a row)."""
    rb = r0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, copy_layout(BLOCK_Q, num_warps)))
    ids = gl.load(row_ids_ptr + rb, mask=rb < hi, other=0)
    if OFFSETS_32:
        offs = ids * stride_gm
    else:
        offs = ids.to(gl.int64) * stride_gm
    return offs


@gluon.jit
def _copy_rows(slot, rows_ptr, r0, hi, p0, P, stride_rm, BLOCK_P: gl.constexpr, BLOCK_R: gl.constexpr,
               num_warps: gl.constexpr):
    """Starts the cp.async copy of the row-ordered operand's [BLOCK_R, BLOCK_P] tile at
    rows [r0, r0 + BLOCK_R), columns from p0, into ``slot`` (zeros past ``hi`` and P)."""
    layout: gl.constexpr = copy_layout(BLOCK_P, num_warps)
    ra = r0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, layout))
    pa = p0 + gl.arange(0, BLOCK_P, layout=gl.SliceLayout(0, layout))
    async_load(slot, rows_ptr + ra.to(gl.int64)[:, None] * stride_rm + pa[None, :],
                mask=(ra < hi)[:, None] & (pa < P)[None, :])


@gluon.jit
def _gathered_columns(gathered_ptr, q0, Q, BLOCK_Q: gl.constexpr, BLOCK_R: gl.constexpr, num_warps: gl.constexpr):
    """What every reduction step of a tile at gathered columns ``q0 ..`` shares: the
    pointers to its first gathered row's columns ([1, BLOCK_Q]) and the columns' mask in
    the copy's full [BLOCK_R, BLOCK_Q] shape."""
    layout: gl.constexpr = copy_layout(BLOCK_Q, num_warps)
    qb = q0 + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, layout))
    steps_rows = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, layout))
    return gathered_ptr + qb[None, :], (steps_rows >= 0)[:, None] & (qb < Q)[None, :]


@gluon.jit
def _copy_gathered(slot, g_src, g_offs, g_cols, r0, hi, BLOCK_R: gl.constexpr):
    """Starts the cp.async copy of reduction step [r0, r0 + BLOCK_R)'s gathered rows into
    ``slot``: row offsets ``g_offs`` (``_gathered_offsets``) from the tile's ``g_src``
    within its columns ``g_cols`` (``_gathered_columns``), zeros past ``hi``."""
    steps_rows = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, g_cols.type.layout))
    async_load(slot, g_src + g_offs[:, None], mask=g_cols & (r0 + steps_rows < hi)[:, None])


@gluon.jit
def _wgrad_tile(tile, offsets_ptr, P, Q, LONG_ROWS, BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr,
                BAND: gl.constexpr):
    """(expert, first P, first Q, the expert's rows [lo, hi)) of output tile ``tile``, each
    expert's [P, Q] tiles in an order chosen by its row count. Up to ``LONG_ROWS`` rows,
    Q fastest along each P-tile: the expert's gathered rows stay in L2 from one wave of
    programs to the next. Above, where they cannot, in bands of ``BAND`` P-tiles, P
    fastest inside a band: a wave then spans about as many P as Q columns, the least it
    can read, shared by its programs while they are in step."""
    p_tiles = gl.cdiv(P, BLOCK_P)
    q_tiles = gl.cdiv(Q, BLOCK_Q)
    e = tile // (p_tiles * q_tiles)
    within = tile % (p_tiles * q_tiles)
    lo = gl.load(offsets_ptr + e)
    hi = gl.load(offsets_ptr + e + 1)
    band = gl.where(hi - lo > LONG_ROWS, BAND, 1)
    first = within // (band * q_tiles) * band
    height = gl.minimum(p_tiles - first, band)
    within = within % (band * q_tiles)
    return e, (first + within % height) * BLOCK_P, (within // height) * BLOCK_Q, lo, hi


@gluon.jit
def _store_expert_tile(out_ptr, acc, e, m0, n0, M, N, stride_oe, stride_om, stride_on):
    """Stores expert ``e``'s [M, N] accumulator tile at (m0, n0), inside M and N."""
    layout: gl.constexpr = acc.type.layout
    ms = m0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    ns = n0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(out_ptr + e.to(gl.int64) * stride_oe + ms[:, None] * stride_om + ns[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=(ms < M)[:, None] & (ns < N)[None, :])


@gluon.jit
def _store_tile(out_ptr, out_desc, out_buf, acc, e, m0, n0, M, N, stride_oe, stride_om, stride_on,
                TMA_STORE: gl.constexpr, OUT_TRANSPOSED: gl.constexpr, STORE_PIECES: gl.constexpr):
    """Stores expert ``e``'s [M, N] accumulator tile at (m0, n0): by TMA where
    ``TMA_STORE`` (``common.store_by_tma``), whole or in ``STORE_PIECES`` = 2 column
    halves, else from registers through the strides."""
    if TMA_STORE:
        store_tile_by_tma(out_desc, out_buf, acc, e, m0, n0, OUT_TRANSPOSED, STORE_PIECES)
    else:
        _store_expert_tile(out_ptr, acc, e, m0, n0, M, N, stride_oe, stride_om, stride_on)


@gluon.jit
def _drain(TMA_STORE: gl.constexpr):
    """Waits for the program's last copies: cp.async groups, and the last TMA store, which
    must have read its buffer before the program's shared memory goes."""
    cp.wait_group(0)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _issue_rows_tma_step(rows_desc, rows_ptr, g_src, g_offs, g_cols, g_slot, r_slot, bar, r0, hi, p0, P, stride_rm,
                         BLOCK_P: gl.constexpr, BLOCK_R: gl.constexpr, num_warps: gl.constexpr):
    """Starts the copies of reduction step [r0, r0 + BLOCK_R) into one ring slot: the
    gathered rows by cp.async, at row offsets ``g_offs`` (``_gathered_offsets``) from the
    tile's ``g_src`` within its columns ``g_cols`` (``_gathered_columns``), and the
    row-ordered [BLOCK_R, BLOCK_P] by TMA onto ``bar`` where the step lies inside the
    expert, else by masked cp.async (then ``bar`` completes its phase with a plain
    arrive). The copy threads issue one instruction after another with nothing to hide
    their latencies: what the tile's steps share is made once a tile."""
    if r0 + BLOCK_R <= hi:
        mbarrier.expect(bar, rows_desc.block_type.nbytes)
        tma_load(rows_desc, [r0, p0], bar, r_slot)
        async_load(g_slot, g_src + g_offs[:, None], mask=g_cols)
    else:  # the expert's last, partial step
        _copy_rows(r_slot, rows_ptr, r0, hi, p0, P, stride_rm, BLOCK_P, BLOCK_R, num_warps)
        mbarrier.arrive(bar)
        _copy_gathered(g_slot, g_src, g_offs, g_cols, r0, hi, BLOCK_R)


@gluon.jit
def _wgrad_rows_tma_ws_producer(rows_desc, rows_ptr, gathered_ptr, row_ids_ptr, offsets_ptr, g_ring, r_ring, ready,
                                empty, E, P, Q, LONG_ROWS, stride_rm, stride_gm, BLOCK_P: gl.constexpr,
                                BLOCK_Q: gl.constexpr, BLOCK_R: gl.constexpr, WARPS: gl.constexpr,
                                G_OFFSETS_32: gl.constexpr, BAND: gl.constexpr):
    """The copy warpgroup of ``_wgrad_rows_tma_ws_kernel``: for every reduction step of this
    program's tiles, wait until the MMA has released the step's ring slot, then start its
    copies (``_issue_rows_tma_step``), each thread arriving on the slot's ``ready`` once its
    cp.async copies have landed. The next step's gathered row offsets are made while this
    step's copies are issued."""
    NUM_STAGES: gl.constexpr = g_ring.type.shape[0]
    step = 0
    for tile in range(gl.program_id(0), E * gl.cdiv(P, BLOCK_P) * gl.cdiv(Q, BLOCK_Q), gl.num_programs(0)):
        _, p0, q0, lo, hi = _wgrad_tile(tile, offsets_ptr, P, Q, LONG_ROWS, BLOCK_P, BLOCK_Q, BAND)
        g_src, g_cols = _gathered_columns(gathered_ptr, q0, Q, BLOCK_Q, BLOCK_R, WARPS)
        offs = _gathered_offsets(row_ids_ptr, lo, hi, stride_gm, G_OFFSETS_32, BLOCK_Q, BLOCK_R, WARPS)
        for r0 in range(lo, hi, BLOCK_R):
            next_offs = _gathered_offsets(row_ids_ptr, r0 + BLOCK_R, hi, stride_gm, G_OFFSETS_32, BLOCK_Q, BLOCK_R,
                                          WARPS)
            slot = step % NUM_STAGES
            # A fresh barrier has completed no phase: the first pass over the ring waits for nothing.
            mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)
            _issue_rows_tma_step(rows_desc, rows_ptr, g_src, offs, g_cols, g_ring.index(slot), r_ring.index(slot),
                                 ready.index(slot), r0, hi, p0, P, stride_rm, BLOCK_P, BLOCK_R, WARPS)
            cp.mbarrier_arrive(ready.index(slot), increment_count=False)
            offs = next_offs
            step += 1


@gluon.jit
def _wgrad_rows_tma_ws_consumer(g_ring, r_ring, ready, empty, offsets_ptr, out_ptr, out_desc, out_buf, E, P, Q,
                                LONG_ROWS, stride_oe, stride_op, stride_oq, BLOCK_P: gl.constexpr,
                                BLOCK_Q: gl.constexpr, BLOCK_R: gl.constexpr, TMA_STORE: gl.constexpr,
                                OUT_TRANSPOSED: gl.constexpr, STORE_PIECES: gl.constexpr, WARPS: gl.constexpr,
                                BAND: gl.constexpr, GROUP: gl.constexpr = 0, GROUPS: gl.constexpr = 1):
    """MMA warps of ``_wgrad_rows_tma_ws_kernel``: each tile's steps
    (``row_gemm.ws_tile_steps``, the gathered rows' slot as the transposed left
    operand), then the [Q, P] tile stored (``_store_tile``). With ``GROUPS`` MMA
    partitions (2: a warpgroup each), this one, number ``GROUP``, takes the tile's
    ``GROUP``-th part of its Q rows, its own output buffer, and releases each slot by its
    own arrival (``empty`` counts ``GROUPS``), waiting for no other warpgroup."""
    ROWS: gl.constexpr = BLOCK_Q // GROUPS
    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_P, WARPS)
    step = 0
    for tile in range(gl.program_id(0), E * gl.cdiv(P, BLOCK_P) * gl.cdiv(Q, BLOCK_Q), gl.num_programs(0)):
        e, p0, q0, lo, hi = _wgrad_tile(tile, offsets_ptr, P, Q, LONG_ROWS, BLOCK_P, BLOCK_Q, BAND)
        acc = gl.zeros([ROWS, BLOCK_P], gl.float32, acc_layout)
        # An empty expert's tile has no steps: its gradient is the zeros stored below.
        acc, step = ws_tile_steps(acc, step, gl.cdiv(hi - lo, BLOCK_R), g_ring, r_ring, ready, ready, empty, True,
                                  False, BLOCK_P, BLOCK_R, ONE_READY=True, A_TRANSPOSED=True, A_FIRST_ROW=GROUP * ROWS)
        _store_tile(out_ptr, out_desc, out_buf, acc, e, q0 + GROUP * ROWS, p0, Q, P, stride_oe, stride_oq, stride_op,
                    TMA_STORE, OUT_TRANSPOSED, STORE_PIECES)
    _drain(TMA_STORE)


@gluon.jit
def _wgrad_rows_tma_ws_kernel(
    rows_desc, rows_ptr, gathered_ptr, row_ids_ptr, offsets_ptr, out_ptr, out_desc,
    E, P, Q, LONG_ROWS,
    stride_rm, stride_gm, stride_oe, stride_op, stride_oq,
    BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_R: gl.constexpr, NUM_STAGES: gl.constexpr,
    TMA_STORE: gl.constexpr, OUT_TRANSPOSED: gl.constexpr, STORE_PIECES: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, MMA_GROUPS: gl.constexpr, MMA_REGS: gl.constexpr,
    G_OFFSETS_32: gl.constexpr, BAND: gl.constexpr, num_warps: gl.constexpr,
):
    """The weight gradient: ``PRODUCER_WARPS`` warps gather the rows by cp.async and start
    the row-ordered tiles' TMA, the MMA warps run the wgmma (the gathered rows' slot as the
    transposed left operand, the row-ordered tile as the right one) and store each [Q, P]
    tile, by TMA where ``TMA_STORE`` (running beside the next tile's MMAs), else from
    registers. Each ring slot has two mbarriers: ``ready`` (every copy thread's cp.async
    copies and the TMA bytes landed) and ``empty`` (the MMA is done with it).
    ``MMA_GROUPS`` 1: the ``num_warps`` MMA warps are one partition; 2: two partitions of
    ``num_warps`` (a warpgroup each, the second with ``MMA_REGS`` registers a thread), each
    over half the tile's Q rows (``out_desc``'s box is such a half's)."""
    dtype: gl.constexpr = rows_ptr.dtype.element_ty
    g_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_R, BLOCK_Q],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_Q], dtype))
    r_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES] + rows_desc.block_type.shape, rows_desc.layout)
    # Every copy thread arrives once its cp.async copies land, and one more arrival comes
    # with the row-ordered tile: the TMA's expected bytes, or a plain arrive after the
    # masked copy of an expert's partial last step.
    ready = slot_barriers(NUM_STAGES, PRODUCER_WARPS * 32 + 1)
    empty = slot_barriers(NUM_STAGES, MMA_GROUPS)
    out_desc, out_buf = partition_output(out_desc, dtype, TMA_STORE, rows_desc, r_ring)
    if MMA_GROUPS == 1:
        gl.warp_specialize([
            (_wgrad_rows_tma_ws_consumer, (g_ring, r_ring, ready, empty, offsets_ptr, out_ptr, out_desc, out_buf, E, P,
                                           Q, LONG_ROWS, stride_oe, stride_op, stride_oq, BLOCK_P, BLOCK_Q, BLOCK_R,
                                           TMA_STORE, OUT_TRANSPOSED, STORE_PIECES, num_warps, BAND)),
            (_wgrad_rows_tma_ws_producer, (rows_desc, rows_ptr, gathered_ptr, row_ids_ptr, offsets_ptr, g_ring,
                                           r_ring, ready, empty, E, P, Q, LONG_ROWS, stride_rm, stride_gm, BLOCK_P,
                                           BLOCK_Q, BLOCK_R, PRODUCER_WARPS, G_OFFSETS_32, BAND)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])
    else:
        # The second group stores through a buffer of its own: its TMA copies run on
        # while the first group writes its half.
        _, second_buf = partition_output(out_desc, dtype, TMA_STORE, rows_desc, r_ring)
        gl.warp_specialize([
            (_wgrad_rows_tma_ws_consumer, (g_ring, r_ring, ready, empty, offsets_ptr, out_ptr, out_desc, out_buf, E, P,
                                           Q, LONG_ROWS, stride_oe, stride_op, stride_oq, BLOCK_P, BLOCK_Q, BLOCK_R,
                                           TMA_STORE, OUT_TRANSPOSED, STORE_PIECES, num_warps, BAND, 0, MMA_GROUPS)),
            (_wgrad_rows_tma_ws_consumer, (g_ring, r_ring, ready, empty, offsets_ptr, out_ptr, out_desc, second_buf, E,
                                           P, Q, LONG_ROWS, stride_oe, stride_op, stride_oq, BLOCK_P, BLOCK_Q, BLOCK_R,
                                           TMA_STORE, OUT_TRANSPOSED, STORE_PIECES, num_warps, BAND, 1, MMA_GROUPS)),
            (_wgrad_rows_tma_ws_producer, (rows_desc, rows_ptr, gathered_ptr, row_ids_ptr, offsets_ptr, g_ring,
                                           r_ring, ready, empty, E, P, Q, LONG_ROWS, stride_rm, stride_gm, BLOCK_P,
                                           BLOCK_Q, BLOCK_R, PRODUCER_WARPS, G_OFFSETS_32, BAND)),
        ], [num_warps, PRODUCER_WARPS], [MMA_REGS, PRODUCER_REGS])


def applies(rows: torch.Tensor, gathered: torch.Tensor) -> bool:
    """Whether ``launch_wgrad`` handles these operands (else the portable kernel does)."""
    if not (rows.is_cuda and rows.dtype in (torch.bfloat16, torch.float16) and gathered.dtype == rows.dtype):
        return False
    if not on_hopper(rows):
        return False
    aligned = all(n % 16 == 0 for n in (rows.shape[1], gathered.shape[1], rows.stride(0), gathered.stride(0)))
    return (aligned and rows.stride(1) == 1 and gathered.stride(1) == 1
            and rows.data_ptr() % 16 == 0 and gathered.data_ptr() % 16 == 0)


def _output_descriptor(grad_w_pq: torch.Tensor, tile: GemmTile, pieces: int = 2, mma_groups: int = 1):
    """``(descriptor, transposed)`` for ``common.store_by_tma``: the weight gradient as
    the kernel's [E, Q, P] accumulator tiles lie in it, or as [E, P, Q] (``transposed``)
    where Q is the contiguous dimension, with a box of a tile's ``pieces``-th part
    (``common.store_pieces``) of an MMA group's Q rows (``mma_groups``);
    ``(None, False)`` where TMA cannot write it (the kernel then stores from registers)."""
    acc_view = grad_w_pq.transpose(1, 2)
    m, n = tile.block_n // mma_groups, tile.block_m
    transposed = acc_view.stride(2) != 1
    view = acc_view.transpose(1, 2) if transposed else acc_view
    if view.stride(2) != 1 or view.data_ptr() % 16 or any(s * view.element_size() % 16 for s in view.stride()[:2]):
        return None, False
    block = [1, n // pieces, m] if transposed else [1, m, n // pieces]
    return host_descriptor(view, block), transposed


def launch_wgrad(rows, gathered, row_ids, offsets, grad_w_pq, tile: Optional[GemmTile] = None,
                 split_mma: bool = False):
    """``grad_w_pq[e] = rows_e^T @ gathered[row_ids_e]`` (see the module docstring), on
    ``_wgrad_rows_tma_ws_kernel``.

    ``tile`` is (P block, Q block = 16 * warps, R block, warps, stages), ``TILE`` by
    default; one program runs per SM whatever its ``programs_per_sm`` (the partitions'
    registers fill an SM's file). Each output tile is stored by TMA copies that run on
    during the next tile (``common.store_by_tma``), whole where the tile fits beside
    the ring, else in halves (``common.store_pieces``); from registers where TMA
    cannot write the gradient or a program has no next tile. ``split_mma``
    (``config.wgrad_split_mma``): on 8 MMA warps, the two MMA warpgroups run as partitions
    of their own, each over half the tile, releasing the ring's slots without waiting for
    each other."""
    if grad_w_pq.numel() == 0:
        return
    if rows.shape[0] == 0:  # no rows for a TMA descriptor to describe: every expert's sum is empty
        grad_w_pq.zero_()
        return
    tile = tile or TILE
    if tile.block_n != 16 * tile.num_warps or tile.num_stages < 3:
        raise ValueError(f"moeblaze gluon weight gradient: block_n must be 16 * num_warps and num_stages at least 3, "
                         f"got {tile}")
    mma_groups = 2 if split_mma and tile.num_warps == 8 else 1
    E, P, Q = grad_w_pq.shape
    tiles = E * gg.cdiv(P, tile.block_m) * gg.cdiv(Q, tile.block_n)
    grid = (gg.num_programs(rows.device, tiles),)
    # A program with one tile has no next one to run its store beside.
    tma_store = tiles > grid[0]
    pieces = store_pieces(tile, grad_w_pq.element_size(), grad_w_pq.device) if tma_store else 2
    out_desc, out_transposed = (_output_descriptor(grad_w_pq, tile, pieces, mma_groups) if tma_store
                                else (None, False))
    warps, regs = PRODUCER
    launch(_wgrad_rows_tma_ws_kernel, grid, host_descriptor(rows, [tile.block_k, tile.block_m]), rows, gathered,
           row_ids, offsets, grad_w_pq, out_desc, E, P, Q,
           config.wgrad_long_rows(Q, tile.block_m, tile.block_n, grid[0], gathered.element_size(), rows.device),
           rows.stride(0), gathered.stride(0), *grad_w_pq.stride(),
           BLOCK_P=tile.block_m, BLOCK_Q=tile.block_n, BLOCK_R=tile.block_k, NUM_STAGES=tile.num_stages,
           TMA_STORE=out_desc is not None, OUT_TRANSPOSED=out_transposed, STORE_PIECES=pieces,
           PRODUCER_WARPS=warps, PRODUCER_REGS=regs, MMA_GROUPS=mma_groups, MMA_REGS=MMA_GROUP_REGS,
           G_OFFSETS_32=row_offsets_fit_32(gathered), BAND=config.WGRAD_LONG_BAND,
           num_warps=tile.num_warps // mma_groups)
