"""The grouped-GEMM core: the pieces every moeblaze GEMM kernel is made of.

A grouped GEMM multiplies the routed rows of each expert by that expert's weight. The
rows are in expert order, expert e owning rows ``[expert_offsets[e], expert_offsets[e+1])``,
and the offsets stay on the device: every program reads them (no host ever sees the
counts). The pieces, as ``@triton.jit`` helpers that kernels (and Inductor templates)
call in the order loads, MMA, store:

- schedules: ``row_tile`` lays the (m-tile, n-tile) output tiles of all experts end to
  end over one persistent grid, expert by expert, each expert's in bands of
  ``config.ROW_BAND`` m-tiles (``banded``) so programs running side by side share their A
  rows and their expert's weights in L2; the rows past ``expert_offsets[E]`` (sentinels)
  form one more group, whose tiles only write zeros. ``expert_tile`` is the
  weight gradients' schedule: one (expert, p-tile, q-tile) at a time, reducing over the
  expert's own rows.
- operand loads: ``load_rows`` (A rows, gathered through an index array or not),
  ``load_weight_tile`` (an expert's weight as the B operand, plain or through a TMA
  descriptor), ``load_h_pair`` (the raw gate/up tiles an activation is computed from).
- ``store_tile``: the epilogue's masked store.

The host side of the same GEMMs is here too: buffer allocation, the persistent grid, the
TMA descriptors and when they apply, the Gluon module a GEMM runs (``gluon_module``); the
rules that choose are ``config``'s.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import settings
from .. import config
from ..config import GemmTile
from ..launch import launch
from .activations import NUM_GATED

# --------------------------------------------------------------------------- schedules


@triton.jit
def group_bounds(offsets_ptr, E, LK, GROUPS: tl.constexpr):
    """Row range [lo, hi) of each group: the E experts, then group E holding the sentinels."""
    g = tl.arange(0, GROUPS)
    lo = tl.load(offsets_ptr + g, mask=g <= E, other=0)
    hi = tl.load(offsets_ptr + g + 1, mask=g < E, other=0)
    return g, lo, tl.where(g == E, LK, hi)


@triton.jit
def num_row_tiles(offsets_ptr, E, LK, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """How many (m-tile, n-tile) output tiles ``row_tile`` numbers."""
    _, lo, hi = group_bounds(offsets_ptr, E, LK, GROUPS)
    return tl.sum(tl.cdiv(hi - lo, BLOCK_M), axis=0) * tl.cdiv(N, BLOCK_N)


@triton.jit
def banded(tile, rows_total, cols_total, BAND: tl.constexpr):
    """(row, column) of ``tile`` in a rows x cols grid of tiles numbered in bands of ``BAND``
    rows, rows fastest inside a band (the last band may be short). The tiles a wave of
    programs holds at once then span about BAND rows and wave / BAND columns, and share
    their operands in L2; BAND = 1 numbers the columns fastest along each row. Tiles past
    the grid (a producer looking ahead) map past its last row."""
    band = BAND * cols_total
    first = (tile // band) * BAND
    height = tl.maximum(tl.minimum(rows_total - first, BAND), 1)
    within = tile % band
    col = within // height
    # Past the grid in a short last band, the column runs past the last one.
    return tl.where(col < cols_total, first + within % height, rows_total), col


@triton.jit
def row_tile(tile, offsets_ptr, E, LK, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
             BAND: tl.constexpr):
    """(group, first row, rows, row mask, first column, columns, column mask) of output
    tile ``tile``: each group's tiles together, the groups in order (the E experts, then
    the sentinels), a group's m-tiles numbered with the n-tiles in bands of ``BAND``
    (``banded``). A band never spans two experts: the programs a band keeps side by side
    share one expert's weight tiles, which one reading from HBM then serves."""
    g, lo, hi = group_bounds(offsets_ptr, E, LK, GROUPS)
    m_tiles = tl.cdiv(hi - lo, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tile_end = tl.cumsum(m_tiles, axis=0)
    grp = tl.sum((tile_end * n_tiles <= tile).to(tl.int32), axis=0)
    mine = g == grp
    first_tile = tl.sum(tl.where(mine, tile_end - m_tiles, 0), axis=0)
    m, n = banded(tile - first_tile * n_tiles, tl.sum(tl.where(mine, m_tiles, 0), axis=0), n_tiles, BAND)
    row0 = tl.sum(tl.where(mine, lo, 0), axis=0) + m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    n0 = n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    return grp, row0, rows, rows < tl.sum(tl.where(mine, hi, 0), axis=0), n0, cols, cols < N


@triton.jit
def num_expert_tiles(E, P, Q, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr):
    """How many (expert, p-tile, q-tile) tiles ``expert_tile`` numbers."""
    return E * tl.cdiv(P, BLOCK_P) * tl.cdiv(Q, BLOCK_Q)


@triton.jit
def expert_tile(tile, offsets_ptr, P, Q, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr):
    """(expert, its rows [lo, hi), q-tile index, p indices, p mask, q indices, q mask) of
    weight-gradient tile ``tile``, a [P, Q] block of one expert's gradient whose reduction
    runs over the expert's rows. q is fastest, so neighbours share their A rows."""
    p_tiles = tl.cdiv(P, BLOCK_P)
    q_tiles = tl.cdiv(Q, BLOCK_Q)
    e = tile // (p_tiles * q_tiles)
    q_idx = tile % q_tiles
    ps = ((tile // q_tiles) % p_tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = q_idx * BLOCK_Q + tl.arange(0, BLOCK_Q)
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    return e, lo, hi, q_idx, ps, ps < P, qs, qs < Q


# --------------------------------------------------------------------------- operand loads


@triton.jit
def a_rows_of(a_row_ids_ptr, rows, rmask, GATHER_A: tl.constexpr):
    """The A rows (int64) of routed rows ``rows``: ``a_row_ids[rows]`` (token rows of x,
    gathered) with GATHER_A, else the routed rows themselves."""
    if GATHER_A:
        a_rows = tl.load(a_row_ids_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    return a_rows


@triton.jit
def load_rows(a_ptr, row_ids, rmask, k0, K, stride_am, stride_ak, BLOCK_K: tl.constexpr):
    """A [rows, BLOCK_K] tile of A at columns [k0, k0 + BLOCK_K): rows ``row_ids`` (int64:
    gathered token rows, or the routed rows themselves); masked rows and columns read 0."""
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(a_ptr + row_ids[:, None] * stride_am + ks[None, :] * stride_ak,
                   mask=rmask[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def load_weight_tile(w_src, e, k0, n0, stride_we, stride_wk, stride_wn, K, N, W_TMA: tl.constexpr,
                     W_KMAJOR: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Expert e's weight as the B operand: a [BLOCK_K, BLOCK_N] tile at (k0, n0).

    With W_TMA, ``w_src`` is a 3-D TMA descriptor of the [E, ., .] weight whose block is
    [1, BLOCK_N, BLOCK_K] when the reduction dimension is the contiguous one (W_KMAJOR),
    else [1, BLOCK_K, BLOCK_N]: the copy engine fills zeros past the expert's own edges.
    """
    # One return, every branch assigning: code after an early return inside a constexpr
    # `if` is still compiled, and the pointer arithmetic below fails on a descriptor.
    if W_TMA:
        if W_KMAJOR:
            tile = tl.trans(tl.reshape(w_src.load([e, n0, k0]), (BLOCK_N, BLOCK_K)))
        else:
            tile = tl.reshape(w_src.load([e, k0, n0]), (BLOCK_K, BLOCK_N))
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        cols = n0 + tl.arange(0, BLOCK_N)
        tile = tl.load(w_src + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                       mask=(ks < K)[:, None] & (cols < N)[None, :], other=0.0)
    return tile


@triton.jit
def load_h_pair(h_ptr, row0, rmask, stride_hm, k0, I, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The raw h tiles behind activation columns [k0, k0 + BLOCK_K) of rows [row0, row0 +
    BLOCK_M): (gate, up), or (h, h) when activation ``ACT`` is not gated; zero past the
    rows in ``rmask`` and past column I."""
    ks = k0 + tl.arange(0, BLOCK_K)
    h_rows = h_ptr + (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None] * stride_hm
    amask = rmask[:, None] & (ks < I)[None, :]
    if ACT < NUM_GATED:
        if INTERLEAVED:
            ks2 = k0 * 2 + tl.arange(0, 2 * BLOCK_K)
            gu = tl.load(h_rows + ks2[None, :], mask=rmask[:, None] & (ks2 < 2 * I)[None, :], other=0.0)
            g, u = tl.split(tl.reshape(gu, (BLOCK_M, BLOCK_K, 2)))
        else:
            g = tl.load(h_rows + ks[None, :], mask=amask, other=0.0)
            u = tl.load(h_rows + I + ks[None, :], mask=amask, other=0.0)
    else:
        g = tl.load(h_rows + ks[None, :], mask=amask, other=0.0)
        u = g
    return g, u


# --------------------------------------------------------------------------- epilogue


@triton.jit
def add_bias(acc, bias_ptr, e, stride_bias, cols, cmask):
    """acc + expert e's bias row (a [BLOCK_N] broadcast over the tile's rows), in fp32."""
    return acc + tl.load(bias_ptr + e * stride_bias + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]


@triton.jit
def store_tile(out_ptr, rows, cols, stride_om, acc, mask):
    """Stores an fp32 accumulator tile at (rows, cols) in the output's dtype."""
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


# --------------------------------------------------------------------------- host side


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host ints: ``triton.cdiv`` is a constexpr function, which costs
    microseconds a call on the host, tens of times a step."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (n >= 1) of a host int, as ``triton.next_power_of_2``
    (also a constexpr function)."""
    return 1 << max(n - 1, 0).bit_length()


def empty(*shape, dtype, device) -> torch.Tensor:
    """A buffer the kernels fill; NaN-filled first under ``settings.poison``, so an element
    a kernel forgets to write shows."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    if settings.current().poison:
        t.fill_(float("nan"))
    return t


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: fp32 inputs stay fp32 (no silent tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def fast_sigmoid(t: torch.Tensor) -> bool:
    """Whether kernels on tensors like ``t`` use the approximate-tanh sigmoid: on CUDA, for
    16-bit tensors (its error, 2^-11, is below their rounding; one MUFU instruction instead
    of an exponential and a division)."""
    return t.is_cuda and t.dtype != torch.float32


def tile_config(kind: str, t: torch.Tensor, rows=None, experts=None) -> GemmTile:
    """The tile of GEMM ``kind`` on tensors like ``t`` over ``rows`` routed rows of
    ``experts`` experts where given (``config.pick_tile``)."""
    return config.pick_tile(kind, t.dtype, t.device, rows, experts)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    """The SMs of CUDA device ``index`` (a property query costs microseconds on each launch)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device, max_tiles: Optional[int], per_sm: int = 1) -> int:
    """The persistent grid: ``per_sm`` programs per SM, no more than there are tiles (no cap
    where ``max_tiles`` is None: a count not known when the grid is chosen)."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    return max(1, per_sm * sms if max_tiles is None else min(per_sm * sms, max_tiles))


def launch_row_gemm(kernel, tile: GemmTile, dtype: torch.dtype, device: torch.device, n_cols: int, **kwargs):
    """Launches a GEMM on the persistent ``row_tile`` schedule over ``n_cols`` output columns
    (``kwargs`` holds the kernel's arguments, ``LK`` and ``E`` among them)."""
    LK, E = kwargs["LK"], kwargs["E"]
    max_tiles = (cdiv(LK, tile.block_m) + E + 1) * cdiv(n_cols, tile.block_n)
    grid = (num_programs(device, max_tiles, tile.programs_per_sm),)
    launch(kernel, grid, **kwargs, GROUPS=next_power_of_2(E + 1), BAND=config.ROW_BAND,
           PRECISION=precision(dtype), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
           num_warps=tile.num_warps, num_stages=tile.num_stages)


def _import_gluon_module(kind: str):
    """The module of GEMM ``kind``'s Gluon kernel (imported here, not at the top: Gluon exists
    only in newer Triton releases, and only Hopper runs it)."""
    if kind == "dh":
        from .gluon import dh as module
    elif kind in ("wgrad_down", "wgrad_up"):
        from .gluon import wgrad as module
    else:
        from .gluon import row_gemm as module
    return module


def gluon_module(kind: str, flop: int):
    """The Gluon kernel module GEMM ``kind`` of ``flop`` operations runs on CUDA, or None:
    where ``config.runs_gluon`` says so (the module is imported then, and never where this
    Triton has no Gluon). The module's ``applies`` has the last word."""
    if not config.runs_gluon(kind, flop):
        return None
    try:
        return _import_gluon_module(kind)
    except ImportError:
        return None


def gluon_kernels(kind: str, t: torch.Tensor, flop: int):
    """``gluon_module`` for a GEMM on tensors like ``t``: None off CUDA."""
    return gluon_module(kind, flop) if t.is_cuda else None


def _descriptor(t: torch.Tensor, block):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def weight_tma_fits(strides, element_size: int, start_byte: Optional[int], tile: GemmTile) -> bool:
    """Whether a TMA descriptor can read [block_k, block_n] tiles of a 3-D weight with these
    strides (in elements; None where unknown) starting at byte ``start_byte``: the last
    dimension contiguous, the other strides and the start 16-byte aligned (column slabs of
    a weight are such views), a box at most 256 wide."""
    return (strides[2] == 1 and all(s is not None and s * element_size % 16 == 0 for s in strides[:2])
            and start_byte is not None and start_byte % 16 == 0 and max(tile.block_k, tile.block_n) <= 256)


def weight_operand(w: torch.Tensor, stride_reduction: int, tile: GemmTile, kind: str, flop: int):
    """A weight as GEMM ``kind`` of ``flop`` operations reads its [block_k, block_n] B tiles:
    ``(source, through_tma, reduction_contiguous)``; a 3-D TMA descriptor where
    ``config.reads_weight_by_tma`` says so and TMA allows it, else the tensor."""
    kmajor = stride_reduction == 1
    if not (config.reads_weight_by_tma(kind, flop)
            and weight_tma_fits(w.stride(), w.element_size(), w.data_ptr(), tile)):
        return w, False, kmajor
    block = [1, tile.block_n, tile.block_k] if kmajor else [1, tile.block_k, tile.block_n]
    return _descriptor(w, block), True, kmajor
