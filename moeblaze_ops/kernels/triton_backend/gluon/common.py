"""What the Gluon kernels for Hopper share: the register layouts of their copies and
accumulators, the builtins renamed between Triton releases, and the device check."""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import config

# Builtins renamed after triton 3.6: the masked cp.async (``async_copy_global_to_shared``,
# then ``async_load``), the CTA barrier (``thread_barrier``, then ``barrier``), the TMA
# load and store (``async_copy_global_to_shared`` / ``async_copy_shared_to_global``, then
# ``async_load`` / ``async_store``) and a shared-memory view's reinterpretation as another
# dtype, shape and layout (the method ``_reinterpret``, then ``reinterpret``; called here
# as ``reinterpret_shared(view, dtype, shape, layout)``).
async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
reinterpret_shared = (getattr(gl.shared_memory_descriptor, "reinterpret", None)
                      or gl.shared_memory_descriptor._reinterpret)


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def host_descriptor(t: torch.Tensor, block) -> TensorDescriptor:
    """A TMA descriptor of 16-bit ``t`` with ``block`` boxes in the swizzled shared layout
    wgmma reads. The layout is made once per block and dtype: on every launch it cost
    more host time than the descriptor itself."""
    return TensorDescriptor.from_tensor(t, list(block), _shared_layout(tuple(block), t.dtype))


@gluon.constexpr_function
def copy_layout(cols, num_warps):
    """Registers of a [rows, cols] cp.async source: 8 contiguous 16-bit elements (16 bytes) per thread."""
    per_row = min(32, cols // 8)
    return gl.BlockedLayout([1, 8], [32 // per_row, per_row], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def wgmma_acc_layout(cols, num_warps):
    """The wgmma accumulator: warps stacked along the rows, 16 rows each, ``cols`` wide."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def tma_slot_shape(block, boxes):
    """A shared-memory slot that holds ``boxes`` TMA boxes of shape ``block`` stacked along
    its second dimension (the rows of a K-major [1, N, K] weight box)."""
    return [block[0], block[1] * boxes] + list(block[2:])


@gluon.jit
def slot_barriers(NUM_STAGES: gl.constexpr, ARRIVALS: gl.constexpr):
    """One mbarrier per slot of a ring of ``NUM_STAGES``, each completing a phase after
    ``ARRIVALS`` arrivals (and whatever bytes an arrival says to expect)."""
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(bars.index(s), count=ARRIVALS)
    return bars


@gluon.jit
def copy_tma_ring(dtype: gl.constexpr, tma_desc, NUM_STAGES: gl.constexpr, COPY_ROWS: gl.constexpr,
                  COPY_COLS: gl.constexpr, TMA_BOXES: gl.constexpr = 1):
    """A ring of ``NUM_STAGES`` shared-memory slots for a pipeline with two operands: one
    copied by cp.async ([COPY_ROWS, COPY_COLS] slots), one by TMA (``TMA_BOXES`` of
    ``tma_desc``'s block, ``tma_slot_shape``), and one mbarrier per slot, on which its TMA
    bytes land. Returns (cp.async ring, TMA ring, barriers)."""
    copy_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, COPY_ROWS, COPY_COLS],
                                          gl.NVMMASharedLayout.get_default_for([COPY_ROWS, COPY_COLS], dtype))
    tma_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES] + tma_slot_shape(tma_desc.block_type.shape, TMA_BOXES),
                                         tma_desc.layout)
    return copy_ring, tma_ring, slot_barriers(NUM_STAGES, 1)


@gluon.jit
def banded(tile, rows_total, cols_total, BAND: gl.constexpr):
    """(row, column) of ``tile`` in a rows x cols grid of tiles numbered in bands of ``BAND``
    rows, rows fastest inside a band: ``grouped_gemm.banded``, which the ``tl`` kernels
    call (Gluon cannot call ``tl`` functions)."""
    band = BAND * cols_total
    first = (tile // band) * BAND
    height = gl.maximum(gl.minimum(rows_total - first, BAND), 1)
    within = tile % band
    col = within // height
    return gl.where(col < cols_total, first + within % height, rows_total), col


@gluon.jit
def column_halves(acc):
    """The accumulator tile's two column halves. Each thread holds every 8-column piece of
    its rows, so no data moves between threads to split them."""
    return gl.split(acc.reshape([acc.shape[0], 2, acc.shape[1] // 2]).permute((0, 2, 1)))


@gluon.jit
def output_buffer(out_desc, dtype: gl.constexpr, TMA_STORE: gl.constexpr):
    """The shared buffer of ``store_by_tma`` (one piece of an output tile: ``out_desc``'s
    block), or None."""
    if TMA_STORE:
        buf = gl.allocate_shared_memory(dtype, out_desc.block_type.shape, out_desc.layout)
    else:
        buf = None
    return buf


@gluon.jit
def partition_output(out_desc, dtype: gl.constexpr, TMA_STORE: gl.constexpr, stand_in_desc, stand_in_buf):
    """``(out_desc, output_buffer(...))`` for a warp-specialised partition with
    ``TMA_STORE``, else the stand-ins given, which it never reads: a partition's arguments
    cannot be None."""
    if TMA_STORE:
        desc = out_desc
        buf = output_buffer(out_desc, dtype, TMA_STORE)
    else:
        desc = stand_in_desc
        buf = stand_in_buf
    return desc, buf


@gluon.jit
def store_by_tma(out_desc, out_buf, piece, e, m0, n0, TRANSPOSED: gl.constexpr, PENDING: gl.constexpr = 0):
    """Stores ``piece`` ([M, N'] of an accumulator tile: all of it, or a column half) at
    (m0, n0) of block ``e`` of ``out_desc`` (a 3-D descriptor: [E, M, N], or [E, N, M] where
    ``TRANSPOSED``) through the shared buffer ``out_buf`` by a TMA copy, which then runs on
    while the warps go on; the copy engine clips it at the descriptor's edges. ``PENDING``:
    how many of the latest copies may still be reading when ``out_buf`` is written (1 where
    the copy before went from another buffer)."""
    tma.store_wait(PENDING)  # the buffer's last copy has read it (the issuing thread's wait) ...
    cta_barrier()  # ... before any thread writes it again
    if TRANSPOSED:
        out_buf.reshape([piece.shape[1], piece.shape[0]]).permute((1, 0)).store(piece.to(out_desc.dtype))
    else:
        out_buf.reshape([piece.shape[0], piece.shape[1]]).store(piece.to(out_desc.dtype))
    fence_async_shared()  # generic-proxy writes before the copy engine (async proxy) reads them
    cta_barrier()
    if TRANSPOSED:
        tma_store(out_desc, [e, n0, m0], out_buf)
    else:
        tma_store(out_desc, [e, m0, n0], out_buf)


@gluon.jit
def store_tile_by_tma(out_desc, out_buf, acc, e, m0, n0, TRANSPOSED: gl.constexpr, PIECES: gl.constexpr):
    """Stores the accumulator tile ``acc`` at (m0, n0) of block ``e`` of ``out_desc`` by
    ``store_by_tma``: whole (``PIECES`` 1) or in two column halves (``PIECES`` 2, the
    buffer a half), the second waiting for the copy engine to have read the first."""
    if PIECES == 1:
        store_by_tma(out_desc, out_buf, acc, e, m0, n0, TRANSPOSED)
    else:
        first, second = column_halves(acc)
        store_by_tma(out_desc, out_buf, first, e, m0, n0, TRANSPOSED)
        store_by_tma(out_desc, out_buf, second, e, m0, n0 + acc.shape[1] // 2, TRANSPOSED)


#: Shared memory a kernel holds beside its rings and buffers (mbarriers, alignment).
SPARE_SHARED_BYTES = 1024


def store_pieces(tile, element_size: int, device: torch.device) -> int:
    """In how many column pieces a TMA-store epilogue writes each [block_m, block_n] tile
    through its one shared buffer: 1 where the whole tile fits beside the operand ring, so
    a tile's only wait is for the copy of the tile before, started a mainloop earlier;
    else 2, and the second half waits for the copy engine to read the first."""
    whole = tile.block_m * tile.block_n * element_size
    budget = config.shared_memory_per_block(device)
    return 1 if tile.smem_bytes(element_size) + whole + SPARE_SHARED_BYTES <= budget else 2


@functools.lru_cache(maxsize=None)
def is_hopper(index: int) -> bool:
    """Whether CUDA device ``index`` is a Hopper (capability 9) GPU."""
    return torch.cuda.get_device_capability(index)[0] == 9


def on_hopper(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a Hopper GPU."""
    return t.is_cuda and is_hopper(t.device.index if t.device.index is not None else torch.cuda.current_device())


def row_offsets_fit_32(t: torch.Tensor) -> bool:
    """Whether every element offset a kernel forms into the rows of ``t`` (a row's start,
    row index times ``t.stride(0)``, plus a column under the row stride) fits in 32 bits.
    ``numel`` would not bound them for a view whose rows are wider apart than its
    columns."""
    return t.shape[0] * t.stride(0) < 2**31
