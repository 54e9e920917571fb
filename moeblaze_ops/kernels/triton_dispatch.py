"""Triton kernel of ``moeblaze.dispatch``: no global sort, no atomics, counts stay on device.

The flat routed rows ``j = i*K + k`` are cut into chunks, one program per chunk:

1. ``_chunk_histogram``: each program counts its rows per bin (one bin per expert, plus
   bin E for every sentinel id) by summing a one-hot tile; writes ``counts[chunk, bin]``.
2. ``_bin_scan``: for each bin, an exclusive prefix sum over chunks gives where the chunk's
   rows of that bin start inside the bin; the bin totals' prefix sum gives
   ``expert_offsets``.
3. ``_chunk_scatter``: each program ranks its rows inside their bin (a cumulative sum of
   the one-hot tile, in flat order) and writes ``token_index_map[j]`` and
   ``expert_token_indices[pos]``: every position is written by exactly one row.

Ranking in flat order is what a stable sort does, so the result equals the portable
kernel's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUB = 64  # rows ranked per step inside a program (the one-hot tile is SUB x bins)


@triton.jit
def _one_hot(ids_ptr, rows, LK, E, BINS: tl.constexpr):
    ids = tl.load(ids_ptr + rows, mask=rows < LK, other=-1)
    key = tl.minimum(ids, E).to(tl.int32)  # sentinels share bin E; padding (-1) matches no bin
    return (key[:, None] == tl.arange(0, BINS)[None, :]).to(tl.int32)


@triton.jit
def _chunk_histogram(ids_ptr, counts_ptr, LK, E, CHUNK, BINS: tl.constexpr, SUB: tl.constexpr):
    chunk = tl.program_id(0)
    acc = tl.zeros((BINS,), dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        rows = chunk * CHUNK + s + tl.arange(0, SUB)
        acc += tl.sum(_one_hot(ids_ptr, rows, LK, E, BINS), axis=0)
    tl.store(counts_ptr + chunk * BINS + tl.arange(0, BINS), acc)


@triton.jit
def _bin_scan(counts_ptr, totals_ptr, offsets_ptr, NUM_CHUNKS, E, BINS: tl.constexpr, ROWS: tl.constexpr):
    # One program: the [NUM_CHUNKS, BINS] counts become exclusive per-bin starts, in place.
    bins = tl.arange(0, BINS)
    carry = tl.zeros((BINS,), dtype=tl.int32)
    for r in range(0, NUM_CHUNKS, ROWS):
        rows = r + tl.arange(0, ROWS)
        ptrs = counts_ptr + rows[:, None] * BINS + bins[None, :]
        mask = (rows < NUM_CHUNKS)[:, None]
        c = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(c, axis=0) - c + carry[None, :], mask=mask)
        carry += tl.sum(c, axis=0)
    starts = tl.cumsum(carry, axis=0) - carry  # exclusive: where each bin begins
    tl.store(totals_ptr + bins, starts)
    tl.store(offsets_ptr + bins, starts, mask=bins <= E)


@triton.jit
def _chunk_scatter(ids_ptr, starts_ptr, bin_starts_ptr, eti_ptr, tim_ptr, LK, E, K, CHUNK,
                   BINS: tl.constexpr, SUB: tl.constexpr):
    chunk = tl.program_id(0)
    bins = tl.arange(0, BINS)
    carry = tl.load(starts_ptr + chunk * BINS + bins) + tl.load(bin_starts_ptr + bins)
    for s in range(0, CHUNK, SUB):
        rows = chunk * CHUNK + s + tl.arange(0, SUB)
        hot = _one_hot(ids_ptr, rows, LK, E, BINS)
        # Position = where this chunk's rows of the bin start + earlier rows of the bin.
        pos = tl.sum(hot * (tl.cumsum(hot, axis=0) - 1 + carry[None, :]), axis=1)
        carry += tl.sum(hot, axis=0)
        valid = rows < LK
        tl.store(tim_ptr + rows, pos, mask=valid)
        tl.store(eti_ptr + pos, (rows // K).to(tl.int32), mask=valid)


def _chunk_size(LK: int) -> int:
    # Enough programs to fill the GPU, few enough chunks that the scan stays short.
    return max(SUB, min(8192, triton.next_power_of_2(triton.cdiv(LK, 1024))))


def dispatch(topk_ids: torch.Tensor, num_experts: int):
    L, K = topk_ids.shape
    LK = L * K
    dev = topk_ids.device
    E = num_experts
    BINS = triton.next_power_of_2(E + 1)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    chunk = _chunk_size(LK)
    num_chunks = max(1, triton.cdiv(LK, chunk))
    counts = torch.empty(num_chunks, BINS, dtype=torch.int32, device=dev)
    bin_starts = torch.empty(BINS, dtype=torch.int32, device=dev)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    eti = torch.empty(LK, dtype=torch.int32, device=dev)
    tim = torch.empty(LK, dtype=torch.int32, device=dev)
    _chunk_histogram[(num_chunks,)](ids, counts, LK, E, chunk, BINS=BINS, SUB=SUB)
    _bin_scan[(1,)](counts, bin_starts, offsets, num_chunks, E, BINS=BINS, ROWS=max(1, 4096 // BINS))
    if LK > 0:
        _chunk_scatter[(num_chunks,)](ids, counts, bin_starts, eti, tim, LK, E, K, chunk, BINS=BINS, SUB=SUB)
    return eti, offsets, tim
