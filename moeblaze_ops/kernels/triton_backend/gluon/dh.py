"""dH on Hopper (sm_90), in Gluon.

The product and epilogue of ``experts_backward._dh_kernel`` (the portable path):
for every routed row r of expert e, ``g = grad_out[token(r)] @ W_down_e^T`` over the
[BLOCK_M, BLOCK_N] tiles of ``grouped_gemm.row_tile``'s schedule; then, from the h tiles
behind the tile's columns, ``(dL/dgate, dL/dup, a) = triton_activations.backward(w * g, h)``
is written as dH (over h when asked), ``w * a`` (the down weight gradient's operand) and
each row's router partial ``<g, a>``.

The kernel (``_dh_kernel``) is the row GEMM's warp-specialised pipeline
(``row_gemm._row_gemm_ws_kernel``: a copy warpgroup gathers the output-gradient rows
by cp.async and issues W_down's TMA, two MMA warpgroups run one 256-wide wgmma each on a
128 x 256 tile) with dH's epilogue in the MMA warps after each tile's reduction
(``_dh_tile_epilogue``), while the copy warps fill the ring with the next tile's first
steps. The epilogue moves the accumulator through an fp32 stage in shared memory, a part
of 64 columns at a time, and takes it back 32 rows at a time beside the matching h, which
reaches shared memory by TMA: a ring of chunks, each landing on an mbarrier of its slot,
the first ones copied during the reduction (h held in registers ahead of its use would take
the registers the epilogue's arithmetic needs). One thread starts a chunk's copy, gate and
up in one 3-D box (``h_boxes``), where a cp.async copy would cost every MMA thread its own
addresses and copies and every warp a wait; each TMA copy the MMA warps issue also costs
them a CTA barrier, so one box a chunk rather than two. The stage is the W_down slot of
the tile's last reduction step, held back from the copies until the epilogue is done with
it, so the ring keeps its four slots.

Applies where ``row_gemm`` applies to the GEMM (16-bit, Hopper, 16-element aligned
K, N and strides), the layout is concatenated (gate columns, then up) or the activation
not gated, and the layer has no down bias; everything else takes the portable kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ....layouts import linear_dims
from ... import config
from .. import grouped_gemm as gg
from .. import activations as acts
from ...config import GemmTile
from .common import (SPARE_SHARED_BYTES, cta_barrier, host_descriptor, on_hopper, reinterpret_shared,
                           row_offsets_fit_32, slot_barriers, tma_load, wgmma_acc_layout)
from .row_gemm import PRODUCER_GATHER, _row_tile, _schedule, _weight_view, _ws_producer, ws_tile_steps
from .row_gemm import applies as row_gemm_applies
from ...launch import launch
from ..combine import row_combine_weights
from ..experts_backward import _column_slice, dh_outputs

#: Rows of an epilogue chunk: 8 of the accumulator's elements a thread in 8 warps.
CHUNK = 32
#: Columns of each router partial: a part of a tile (a quarter of the default tile's),
#: which the epilogue stages at once.
PART_COLUMNS = 64
#: The program's tile: 128 x 256 outputs on two MMA warpgroups (one 256-wide wgmma each),
#: 64 of K per step, 4 slots of 48 KB (the fp32 stage in one of them): 32 KB are left for
#: four chunks of h.
TILE = GemmTile(128, 256, 64, 8, 4)
#: The copy warpgroup, both operands from one partition: 12 warps in all, as in the row
#: GEMM (with a copy partition for each, 16 warps launch with 128 registers a thread,
#: fewer than the 256-wide wgmma takes).
PRODUCER = PRODUCER_GATHER


@gluon.constexpr_function
def _chunk_layout(cols, num_warps):
    """An epilogue chunk's registers: 8 contiguous columns (16 bytes of h and dH) per thread."""
    return gl.BlockedLayout([1, 8], [32 // (cols // 8), cols // 8], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _stage_layout():
    """The fp32 stage of an accumulator part: 16-byte groups swizzled by row, so that the
    accumulator's stores (2 elements a thread, 8 rows a warp) and the chunks' loads (8 a
    thread along a row) both spread over the banks."""
    return gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0])


@gluon.jit
def _copy_h_chunk(h_desc, h_ring, h_ready, row0, n0, j: gl.constexpr, BLOCK_M: gl.constexpr, CHUNK: gl.constexpr,
                  PART_COLUMNS: gl.constexpr):
    """Starts the TMA copy of the h behind chunk ``j`` of a tile's epilogue
    (``_dh_tile_epilogue``: rows (j % chunks) * CHUNK .. of the part of PART_COLUMNS
    columns j // chunks), gate and up in one box of ``h_desc`` (``h_boxes``), into slot j %
    slots of ``h_ring``; it lands on the slot's ``h_ready`` barrier. Rows past the expert's
    end come in too (another expert's h, or zeros past L*K): their gradient is zero and
    their outputs are masked."""
    CHUNKS: gl.constexpr = BLOCK_M // CHUNK
    slot: gl.constexpr = j % h_ring.shape[0]
    bar = h_ready.index(slot)
    mbarrier.expect(bar, h_desc.block_type.nbytes)
    tma_load(h_desc, [0, row0 + (j % CHUNKS) * CHUNK, n0 + (j // CHUNKS) * PART_COLUMNS], bar, h_ring.index(slot))


@gluon.jit
def _copy_first_h_chunks(h_desc, h_ring, h_ready, row0, n0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         CHUNK: gl.constexpr, PART_COLUMNS: gl.constexpr):
    """The copies of a tile's first chunks of h, one per slot: a kernel starts them before
    the tile's reduction, to have them in shared memory when the epilogue starts."""
    TOTAL: gl.constexpr = (BLOCK_N // PART_COLUMNS) * (BLOCK_M // CHUNK)
    SLOTS: gl.constexpr = h_ring.shape[0]
    cta_barrier()  # the warps are done reading the last tile's chunks
    for j in gl.static_range(SLOTS):
        if j < TOTAL:
            _copy_h_chunk(h_desc, h_ring, h_ready, row0, n0, j, BLOCK_M, CHUNK, PART_COLUMNS)


@gluon.constexpr_function
def _h_rows_layout(box_layout):
    """A ring slot of h read as [gates * CHUNK, PART_COLUMNS] rows: a 3-D [gates, CHUNK,
    PART_COLUMNS] TMA box lands as those rows (its swizzle goes by address), so gate and up
    are each a slice of CHUNK rows."""
    return gl.NVMMASharedLayout(box_layout.swizzle_byte_width, box_layout.element_bitwidth, rank=2)


@gluon.jit
def _dh_tile_epilogue(acc, h_desc, h_ring, h_ready, tiles_done, stage, weights, grp, row0, row_end, n0, eti_ptr,
                      tw_ptr, tim_ptr, dh_ptr, wact_ptr, part_ptr, E, I, alpha, limit, n_parts, stride_dhm,
                      stride_wam, stride_tw0, stride_tw1, K: gl.constexpr, ACT: gl.constexpr,
                      WRITE_WACT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      PART_COLUMNS: gl.constexpr, CHUNK: gl.constexpr, WARPS: gl.constexpr):
    """The epilogue of one [BLOCK_M, BLOCK_N] tile ``acc`` (dL/da / w) at rows ``row0 ..``
    of group ``grp`` and activation columns ``n0 ..``, by the ``WARPS`` warps that hold it:
    ``dh_outputs`` over parts of ``PART_COLUMNS`` columns, each staged in ``stage``
    ([BLOCK_M, PART_COLUMNS] fp32) and taken ``CHUNK`` rows at a time, their h from the
    ring ``h_ring`` (``_copy_h_chunk``; the caller has started the first slots'), each
    slot refilled with the chunk a ring ahead once read; one router partial per row and
    part. ``tiles_done``: the program's tiles before this one, for the phases of the
    slots' ``h_ready`` barriers. The sentinel group's tiles (no reduction) leave the
    stage alone, as it may be a ring slot they do not hold, and take zeros for the
    product."""
    PARTS: gl.constexpr = BLOCK_N // PART_COLUMNS
    CHUNKS: gl.constexpr = BLOCK_M // CHUNK
    TOTAL: gl.constexpr = PARTS * CHUNKS
    SLOTS: gl.constexpr = h_ring.shape[0]
    GATES: gl.constexpr = h_ring.shape[1]
    layout: gl.constexpr = _chunk_layout(PART_COLUMNS, WARPS)
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    tile_rows = row0 + gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    real = (tile_rows < row_end) & (grp < E)
    tok = gl.load(eti_ptr + tile_rows, mask=real, other=0).to(gl.int64)
    cta_barrier()  # the warps are done reading the last tile's weights
    weights.store(row_combine_weights(tw_ptr, tim_ptr, tok, tile_rows, real, stride_tw0, stride_tw1, K))
    # The accumulator leaves the registers a part at a time and comes back CHUNK rows at a
    # time: a whole tile in registers leaves too few of them for the epilogue's
    # temporaries.
    # Chunk j is rows (j % CHUNKS) * CHUNK .. of part j // CHUNKS (constant expressions
    # written out in place: a constexpr cannot be reassigned in an unrolled loop).
    for j in gl.static_range(TOTAL):
        if j % CHUNKS == 0:
            cta_barrier()  # the warps are done reading the stage
            if grp < E:
                stage.store(_column_slice(acc, j // CHUNKS, PARTS, BLOCK_M, BLOCK_N))
            cta_barrier()
        # Chunk j's copies have landed: its slot's barrier completes once per chunk the
        # slot holds, the same number of times in every tile.
        mbarrier.wait(h_ready.index(j % SLOTS),
                      (tiles_done * (TOTAL // SLOTS + (j % SLOTS < TOTAL % SLOTS)) + j // SLOTS) & 1)
        # The slot's box as rows, a view of one power-of-two shape (the ring's slot count
        # need not be one).
        h_rows = reinterpret_shared(h_ring.index(j % SLOTS), h_ring.dtype, [GATES * CHUNK, PART_COLUMNS],
                                    _h_rows_layout(h_ring.layout))
        hg = h_rows.slice(0, CHUNK, dim=0).load(layout)
        if GATES == 2:  # a gated activation's box holds the chunk's up columns after its gate columns
            hu = h_rows.slice(CHUNK, CHUNK, dim=0).load(layout)
        else:
            hu = hg
        rows = row0 + (j % CHUNKS) * CHUNK + gl.arange(0, CHUNK, layout=row_layout)
        cols0 = n0 + (j // CHUNKS) * PART_COLUMNS
        g = gl.where(grp < E, stage.slice((j % CHUNKS) * CHUNK, CHUNK, dim=0).load(layout), 0.0)
        w = weights.slice((j % CHUNKS) * CHUNK, CHUNK).load(row_layout)
        cols = cols0 + gl.arange(0, PART_COLUMNS, layout=gl.SliceLayout(0, layout))
        partial = dh_outputs(g, w[:, None], hg, hu, rows, rows < row_end, cols, cols < I, cols0, I, dh_ptr, wact_ptr,
                             stride_dhm, stride_wam, alpha, limit, ACT, False, WRITE_WACT, True, PART_COLUMNS)
        gl.store(part_ptr + rows.to(gl.int64) * n_parts + cols0 // PART_COLUMNS, partial,
                 mask=(rows < row_end) & (cols0 < I))
        if j + SLOTS < TOTAL:
            cta_barrier()  # every warp has read the slot: the copy may overwrite it
            _copy_h_chunk(h_desc, h_ring, h_ready, row0, n0, j + SLOTS, BLOCK_M, CHUNK, PART_COLUMNS)


@gluon.jit
def _dh_consumer(a_ring, b_ring, a_ready, b_ready, empty, h_desc, h_ring, h_ready, stage, weights, eti_ptr, tw_ptr,
                 tim_ptr, offsets_ptr, dh_ptr, wact_ptr, part_ptr, LK, E, D, I, alpha, limit, n_parts, stride_dhm,
                 stride_wam, stride_tw0, stride_tw1, K: gl.constexpr, ACT: gl.constexpr, WRITE_WACT: gl.constexpr,
                 W_KMAJOR: gl.constexpr, GROUPS: gl.constexpr, BAND: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, PART_COLUMNS: gl.constexpr,
                 CHUNK: gl.constexpr, STAGE_IN_RING: gl.constexpr, num_warps: gl.constexpr):
    """The MMA warps: each of the program's tiles multiplied on the ring by both
    warpgroups at once (``ws_tile_steps``), then ``_dh_tile_epilogue``, while the copy
    warps fill the ring with the next tile's first steps. ``STAGE_IN_RING``: the epilogue
    stages the accumulator in the W_down slot of the tile's last step, released after it
    (the copies fill the other slots meanwhile), else in ``stage``."""
    NUM_STAGES: gl.constexpr = a_ring.type.shape[0]
    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_N, num_warps)
    tile_end, n_tiles, k_steps, total = _schedule(offsets_ptr, E, LK, I, D, BLOCK_M, BLOCK_N, BLOCK_K, GROUPS,
                                                  num_warps)
    step = 0
    tiles_done = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        grp, row0, row_end, n0 = _row_tile(tile, offsets_ptr, tile_end, E, LK, n_tiles, BLOCK_M, BLOCK_N, BAND)
        # The epilogue's first h chunks land during the reduction.
        _copy_first_h_chunks(h_desc, h_ring, h_ready, row0, n0, BLOCK_M, BLOCK_N, CHUNK, PART_COLUMNS)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        if grp < E:  # the sentinel tiles: zeros everywhere
            acc, step = ws_tile_steps(acc, step, k_steps, a_ring, b_ring, a_ready, b_ready, empty, True, W_KMAJOR,
                                      BLOCK_N, BLOCK_K, HOLD_LAST=STAGE_IN_RING)
        held = (step + NUM_STAGES - 1) % NUM_STAGES  # the slot of the tile's last step
        if STAGE_IN_RING:
            tile_stage = reinterpret_shared(b_ring.index(held), gl.float32, [BLOCK_M, PART_COLUMNS], _stage_layout())
        else:
            tile_stage = stage
        _dh_tile_epilogue(acc, h_desc, h_ring, h_ready, tiles_done, tile_stage, weights, grp, row0, row_end, n0,
                          eti_ptr, tw_ptr, tim_ptr, dh_ptr, wact_ptr, part_ptr, E, I, alpha, limit, n_parts,
                          stride_dhm, stride_wam, stride_tw0, stride_tw1, K, ACT, WRITE_WACT, BLOCK_M, BLOCK_N,
                          PART_COLUMNS, CHUNK, num_warps)
        tiles_done += 1
        if STAGE_IN_RING:
            # The stage was written and read through the generic proxy; TMA refills it
            # through the async one.
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(empty.index(held), pred=grp < E)


@gluon.jit
def _dh_kernel(
    go_ptr, w_desc, h_desc, eti_ptr, tw_ptr, tim_ptr, offsets_ptr, dh_ptr, wact_ptr, part_ptr,
    LK, E, D, I, alpha, limit, n_parts,
    stride_gm, stride_dhm, stride_wam, stride_tw0, stride_tw1,
    K: gl.constexpr, ACT: gl.constexpr, WRITE_WACT: gl.constexpr, W_KMAJOR: gl.constexpr,
    GROUPS: gl.constexpr, BAND: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    NUM_STAGES: gl.constexpr, PART_COLUMNS: gl.constexpr, CHUNK: gl.constexpr, H_SLOTS: gl.constexpr,
    STAGE_IN_RING: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    A_OFFSETS_32: gl.constexpr, num_warps: gl.constexpr,
):
    """dH on one [BLOCK_M, BLOCK_N] tile per program at a time, ``num_warps`` MMA warps (two
    warpgroups, one wgmma BLOCK_N wide each) that also run the epilogue, and a copy
    warpgroup of ``PRODUCER_WARPS`` that gathers the output-gradient rows by cp.async and
    issues W_down's TMA: the row GEMM's warp-specialised pipeline
    (``row_gemm._row_gemm_ws_kernel``) with dH's epilogue."""
    dtype: gl.constexpr = go_ptr.dtype.element_ty
    a_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype))
    b_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES] + w_desc.block_type.shape, w_desc.layout)
    if STAGE_IN_RING:
        stage = b_ring  # unused: the consumer stages in a slot of it
    else:
        stage = gl.allocate_shared_memory(gl.float32, [BLOCK_M, PART_COLUMNS], _stage_layout())
    weights = gl.allocate_shared_memory(gl.float32, [BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    h_ring = gl.allocate_shared_memory(dtype, [H_SLOTS] + h_desc.block_type.shape, h_desc.layout)
    h_ready = slot_barriers(H_SLOTS, 1)
    a_ready = slot_barriers(NUM_STAGES, PRODUCER_WARPS * 32)
    b_ready = slot_barriers(NUM_STAGES, 1)
    empty = slot_barriers(NUM_STAGES, 1)
    gl.warp_specialize([
        (_dh_consumer, (a_ring, b_ring, a_ready, b_ready, empty, h_desc, h_ring, h_ready, stage, weights, eti_ptr,
                        tw_ptr, tim_ptr, offsets_ptr, dh_ptr, wact_ptr, part_ptr, LK, E, D, I, alpha, limit, n_parts,
                        stride_dhm, stride_wam, stride_tw0, stride_tw1, K, ACT, WRITE_WACT,
                        W_KMAJOR, GROUPS, BAND, BLOCK_M, BLOCK_N, BLOCK_K, PART_COLUMNS, CHUNK, STAGE_IN_RING,
                        num_warps)),
        (_ws_producer, (go_ptr, w_desc, eti_ptr, offsets_ptr, a_ring, b_ring, a_ready, b_ready, empty, LK, E, I, D,
                        stride_gm, True, W_KMAJOR, GROUPS, BAND, BLOCK_M, BLOCK_N, BLOCK_K, PRODUCER_WARPS, True, True,
                        A_OFFSETS_32)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


def stage_in_ring(tile: GemmTile) -> bool:
    """Whether the kernel stages the accumulator in a W_down ring slot (one holds a
    [block_m, PART_COLUMNS] fp32 part) rather than shared memory of its own."""
    return tile.block_n * tile.block_k * 2 >= tile.block_m * PART_COLUMNS * 4


def h_slots(tile: GemmTile, shared_bytes: int) -> int:
    """Chunks of h in flight for the epilogue (``_copy_h_chunk``): as many as a block's
    ``shared_bytes`` of shared memory hold beside the ring, the fp32 stage (unless in the
    ring) and the weights, up to a tile's chunks (each [CHUNK, PART_COLUMNS] of gate and of
    up, 16-bit). An ungated layer's boxes are half that size, but its ring keeps the same
    count: twice the chunks in flight ran no faster (docs/perf-notes.md)."""
    stage = tile.block_m * (PART_COLUMNS * (not stage_in_ring(tile)) + 1) * 4
    free = shared_bytes - SPARE_SHARED_BYTES - tile.smem_bytes(2) - stage
    chunks = (tile.block_n // PART_COLUMNS) * (tile.block_m // CHUNK)
    return max(0, min(chunks, free // (2 * CHUNK * PART_COLUMNS * 2)))


def h_boxes(h: torch.Tensor, I: int, gated: bool) -> torch.Tensor:
    """h ([L*K, 2I] gate columns then up, or [L*K, I]) as the [gates, L*K, I] view whose TMA
    boxes ``_copy_h_chunk`` copies: a chunk's gate and up in one box, the columns past I
    zero-filled."""
    return h.as_strided((2 if gated else 1, h.shape[0], I), (I, h.stride(0), 1))


def applies(grad_out: torch.Tensor, h: torch.Tensor, w_down: torch.Tensor, transposed: bool, gated: bool,
            interleaved: bool, has_bias: bool) -> bool:
    """Whether ``launch_dh`` handles these operands (else the portable kernel does)."""
    if has_bias or (gated and interleaved) or not on_hopper(h) or h.stride(1) != 1:
        return False
    _, _, I = linear_dims(w_down, transposed)
    # The GEMM: grad_out [L, d] @ W_down^T as [E, d, I], into I columns of rows as wide as h.
    return I % 16 == 0 and row_gemm_applies(grad_out, w_down, h[:, :I], not transposed)


def launch_dh(grad_out, h, w_down, eti, topk_weights, tim, offsets, grad_h, wact, parts, *, act, transposed, alpha,
              limit, tile: Optional[GemmTile] = None, slots: Optional[int] = None):
    """``experts_backward.launch_dh`` without a bias, on ``_dh_kernel``: dH into
    ``grad_h`` (which may be ``h``), ``wact`` = w * act(h) unless None, the router
    partials into ``parts`` ([L*K, cdiv(I, PART_COLUMNS)]), the sigmoid the approximate
    one (16-bit tensors: ``grouped_gemm.fast_sigmoid``), the tiles in bands of
    ``config.ROW_BAND`` m-tiles. ``tile``: the program's (M, N, K block, warps, stages),
    ``TILE`` by default; ``slots``: the chunks of h in flight (``h_slots`` by default)."""
    tile = tile or TILE
    parts_of_tile = tile.block_n // PART_COLUMNS
    if (tile.num_warps not in (4, 8) or tile.block_m != 16 * tile.num_warps or tile.block_m % CHUNK
            or tile.block_n % PART_COLUMNS or parts_of_tile not in (1, 2, 4) or tile.num_stages < 2):
        raise ValueError(f"moeblaze gluon dH: the tile is 4 or 8 warps over 16 rows each, 1, 2 or 4 parts of "
                         f"{PART_COLUMNS} columns, at least 2 stages, got {tile}")
    slots = h_slots(tile, config.shared_memory_per_block(h.device)) if slots is None else slots
    if slots < 1:
        raise ValueError(f"moeblaze gluon dH: no room for a chunk of h in shared memory beside the ring of {tile}")
    LK = h.shape[0]
    E, d, I = linear_dims(w_down, transposed)
    if parts.shape[1] != gg.cdiv(I, PART_COLUMNS):
        raise ValueError(f"moeblaze gluon dH: {parts.shape[1]} router partials per row for {I} columns in parts "
                         f"of {PART_COLUMNS}")
    view, kmajor = _weight_view(w_down, not transposed)
    w_desc = host_descriptor(view, [1, tile.block_n, tile.block_k] if kmajor else [1, tile.block_k, tile.block_n])
    boxes = h_boxes(h, I, acts.is_gated_code(act))
    h_desc = host_descriptor(boxes, [boxes.shape[0], CHUNK, PART_COLUMNS])
    max_tiles = (gg.cdiv(LK, tile.block_m) + E + 1) * gg.cdiv(I, tile.block_n)
    warps, regs = PRODUCER
    launch(
        _dh_kernel, (gg.num_programs(h.device, max_tiles),),
        grad_out, w_desc, h_desc, eti, topk_weights, tim, offsets, grad_h, wact, parts,
        LK, E, d, I, float(alpha), float(limit), parts.shape[1],
        grad_out.stride(0), grad_h.stride(0), wact.stride(0) if wact is not None else 0,
        topk_weights.stride(0), topk_weights.stride(1),
        K=topk_weights.shape[1], ACT=act, WRITE_WACT=wact is not None, W_KMAJOR=kmajor,
        GROUPS=gg.next_power_of_2(E + 1), BAND=config.ROW_BAND, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages, PART_COLUMNS=PART_COLUMNS, CHUNK=CHUNK, H_SLOTS=slots,
        STAGE_IN_RING=stage_in_ring(tile), PRODUCER_WARPS=warps, PRODUCER_REGS=regs,
        A_OFFSETS_32=row_offsets_fit_32(grad_out), num_warps=tile.num_warps,
    )
