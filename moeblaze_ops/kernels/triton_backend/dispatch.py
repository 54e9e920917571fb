"""Triton kernel of ``moeblaze.dispatch``: no global sort, no atomics, counts stay on device.

The flat routed rows ``j = i*K + k`` are cut into chunks, one program per chunk. Each
chunk's counts live in one row of a ``[chunks, BINS + 1]`` table: one column per expert
(``BINS`` is E rounded up to a power of two) and a column for the sentinel ids.

1. ``_chunk_histogram``: each program counts its rows per expert by summing a one-hot
   tile, and its sentinel rows.
2. ``_column_scan``: for each column, an exclusive prefix sum over the chunks turns the
   counts into where each chunk's rows start inside that expert (in place), and leaves
   the column total. Each program scans a few columns in tall tiles of rows
   (``_scan_tile``): many programs, few sequential steps each. A table too tall for few
   steps is scanned in blocks of rows, each started from the sums of the blocks above
   it, which ``_column_block_sums`` makes first (``_scan_blocks``).
3. ``_chunk_scatter``: each program ranks its rows inside their expert in flat order
   (a running count per expert: the chunk's start plus a cumulative sum of the one-hot
   tile) and writes ``token_index_map[j]`` and ``expert_token_indices[pos]``: every
   position is written by exactly one row. Program 0 writes ``expert_offsets``.

Ranking in flat order is what a stable sort does, so the result equals the portable
kernel's bit for bit.

How a program ranks its rows picks one of two kernel families for steps 1 and 3
(``config.dispatch_family`` chooses by the number of bins):

- one-hot tiles of ``SUB`` rows (few bins): O(E) work per row;
- sorted chunks (many bins): the chunk is one block of ``config.DISPATCH_SORT_CHUNK``
  rows whose (column, row) keys are sorted in registers; a row's rank is its distance to
  the start of its run of equal columns, and the last row of each run writes the run's
  length into the table. O(log^2 chunk) work per row, no barrier in the scatter; not a
  global sort, and the result is the same ranking in flat order. The histogram stores
  each row's column and rank in ``token_index_map``, and the scatter reads them there
  (one sort per chunk, not two, and no id loaded twice).

A routing of at most ``config.DISPATCH_ONE_PROGRAM_MAX_ROWS`` rows (a small layer, where
the launches cost more than the work) is one sorted chunk in one program:
``_one_program_dispatch`` ranks, counts and places its rows in one launch, with no table.

``dispatch_checked`` folds the data checks of the ids into these launches: the histogram
also checks the tokens whose first row ``i*K`` lies in its chunk (each token once, also
when its K rows straddle a chunk edge) and writes two more columns, a negative id and a
real expert id repeated in one token's row (``[chunks, BINS + 3]``); the column scan sums
them with the counts, and the scatter's program 0 turns the totals into ``ok`` flags, and
one flag of both that ``torch._assert_async`` reads on the device: no host sync, no extra
reduction, one assertion. Sorted
chunks that hold whole tokens (chunk rows a multiple of K; the one-program chunk always)
read both flags off their sorted runs instead (``_run_flags``): a token's repeated
expert puts two of its rows side by side in that expert's run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...checks import id_values_message, index_values_message
from .. import config
from . import grouped_gemm as gg
from ..launch import launch

SUB = 64  # rows a one-hot step ranks at once
#: Most elements of one ``_column_scan`` tile: 8 warps hold it, with each element's 64-bit
#: address, in registers without spilling.
SCAN_TILE = 4096
#: Most tiles one ``_column_scan`` program walks down a table of one block; a taller table
#: is cut into at most ``SCAN_BLOCKS`` blocks (``_scan_blocks``).
SCAN_STEPS = 4
SCAN_BLOCKS = 64

SENTINEL = tl.constexpr(-2)


@triton.jit
def _keys(ids_ptr, rows, LK, E):
    """Expert ids of ``rows``; every sentinel id becomes SENTINEL and padding past LK -1."""
    ids = tl.load(ids_ptr + rows, mask=rows < LK, other=-1)
    return tl.where(ids >= E, SENTINEL, ids).to(tl.int32)


@triton.jit
def _store_token_flags(ids_ptr, flags_ptr, chunk, CHUNK, LK, E, K: tl.constexpr, TOKENS: tl.constexpr):
    """Writes ``(negative, repeated)`` (0 or 1) of the tokens this chunk owns, those whose
    first row ``i*K`` it holds, into the chunk's two flag columns at ``flags_ptr``: a
    negative id, a real expert id repeated in the token's row (every pair k < k2, unrolled;
    sentinels >= E may repeat). A token straddling the chunk's end is read past it, so every
    token is checked by exactly one program."""
    first_row = chunk.to(tl.int64) * CHUNK
    first = (first_row + K - 1) // K
    end = (tl.minimum(first_row + CHUNK, LK) + K - 1) // K
    negative = tl.zeros((TOKENS,), dtype=tl.int32)
    repeated = tl.zeros((TOKENS,), dtype=tl.int32)
    for t in range(first, end, TOKENS):
        toks = t + tl.arange(0, TOKENS)
        inside = toks < end
        row = ids_ptr + toks * K
        for k in tl.static_range(K):
            a = tl.load(row + k, mask=inside, other=0)
            negative |= (a < 0).to(tl.int32)
            for k2 in tl.static_range(k + 1, K):
                b = tl.load(row + k2, mask=inside, other=0)
                repeated |= ((a == b) & (a >= 0) & (a < E) & inside).to(tl.int32)
    tl.store(flags_ptr, tl.max(negative, axis=0))
    tl.store(flags_ptr + 1, tl.max(repeated, axis=0))


@triton.jit
def _chunk_histogram(ids_ptr, counts_ptr, LK, E, CHUNK, WIDTH, BINS: tl.constexpr, SUB: tl.constexpr,
                     K: tl.constexpr, CHECK_IDS: tl.constexpr, TOKENS: tl.constexpr):
    chunk = tl.program_id(0)
    bins = tl.arange(0, BINS)
    acc = tl.zeros((BINS,), dtype=tl.int32)
    sentinels = 0
    for s in range(0, CHUNK, SUB):
        key = _keys(ids_ptr, chunk * CHUNK + s + tl.arange(0, SUB), LK, E)
        acc += tl.sum((key[:, None] == bins[None, :]).to(tl.int32), axis=0)
        sentinels += tl.sum((key == SENTINEL).to(tl.int32), axis=0)
    row = counts_ptr + chunk * WIDTH
    tl.store(row + bins, acc)
    tl.store(row + BINS, sentinels)
    if CHECK_IDS:
        _store_token_flags(ids_ptr, row + BINS + 1, chunk, CHUNK, LK, E, K, TOKENS)


@triton.jit
def _column_block_sums(counts_ptr, sums_ptr, NUM_CHUNKS, WIDTH, SPAN, COLS: tl.constexpr, ROWS: tl.constexpr):
    """Each column's sum over one block of SPAN table rows (program (column group, block)):
    the first pass of a tall table's scan."""
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    block = tl.program_id(1)
    cmask = cols < WIDTH
    end = tl.minimum((block + 1) * SPAN, NUM_CHUNKS)
    acc = tl.zeros((COLS,), dtype=tl.int32)
    for r in range(block * SPAN, end, ROWS):
        rows = r + tl.arange(0, ROWS)
        mask = (rows < end)[:, None] & cmask[None, :]
        acc += tl.sum(tl.load(counts_ptr + rows[:, None] * WIDTH + cols[None, :], mask=mask, other=0), axis=0)
    tl.store(sums_ptr + block * WIDTH + cols, acc, mask=cmask)


@triton.jit
def _column_scan(counts_ptr, totals_ptr, sums_ptr, NUM_CHUNKS, WIDTH, SPAN, COLS: tl.constexpr, ROWS: tl.constexpr,
                 BLOCKS: tl.constexpr):
    """The exclusive prefix sum of each column over one block of SPAN table rows, in place,
    started from the sums of the blocks above it (``_column_block_sums``; none when the
    table is one block); the last block's programs write the column totals."""
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    block = tl.program_id(1)
    cmask = cols < WIDTH
    carry = tl.zeros((COLS,), dtype=tl.int32)
    if BLOCKS > 1:
        above = tl.arange(0, BLOCKS)
        carry += tl.sum(tl.load(sums_ptr + above[:, None] * WIDTH + cols[None, :],
                                mask=(above < block)[:, None] & cmask[None, :], other=0), axis=0)
    end = tl.minimum((block + 1) * SPAN, NUM_CHUNKS)
    for r in range(block * SPAN, end, ROWS):
        rows = r + tl.arange(0, ROWS)
        ptrs = counts_ptr + rows[:, None] * WIDTH + cols[None, :]
        mask = (rows < end)[:, None] & cmask[None, :]
        c = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(c, axis=0) - c + carry[None, :], mask=mask)
        carry += tl.sum(c, axis=0)
    if block == tl.num_programs(1) - 1:
        tl.store(totals_ptr + cols, carry, mask=cmask)


@triton.jit
def _expert_starts(totals_ptr, offsets_ptr, ok_ptr, E, chunk, BINS: tl.constexpr, CHECK_IDS: tl.constexpr):
    """Where each expert's rows start (expert_offsets[:BINS]) and where the sentinels start
    (expert_offsets[E]), from the column totals; program 0 writes expert_offsets, and ``ok``
    (1 where no chunk flagged a negative id, a repeated id) when checking the ids."""
    bins = tl.arange(0, BINS)
    totals = tl.load(totals_ptr + bins)
    expert_start = tl.cumsum(totals, axis=0) - totals
    real_rows = tl.sum(totals, axis=0)
    if chunk == 0:
        tl.store(offsets_ptr + bins, expert_start, mask=bins < E)
        tl.store(offsets_ptr + E, real_rows)
        if CHECK_IDS:
            flags = tl.arange(0, 2)
            ok = (tl.load(totals_ptr + BINS + 1 + flags) == 0).to(tl.int32)
            tl.store(ok_ptr + flags, ok)
            tl.store(ok_ptr + 2, tl.min(ok, axis=0))
    return expert_start, real_rows


@triton.jit
def _chunk_firsts(starts_ptr, totals_ptr, offsets_ptr, ok_ptr, E, chunk, WIDTH, BINS: tl.constexpr,
                  CHECK_IDS: tl.constexpr):
    """Where this chunk's first row of each expert goes (``[BINS]``), and its first
    sentinel row: the chunk's scanned table row plus each column's start."""
    expert_start, real_rows = _expert_starts(totals_ptr, offsets_ptr, ok_ptr, E, chunk, BINS, CHECK_IDS)
    row = starts_ptr + chunk * WIDTH
    return tl.load(row + tl.arange(0, BINS)) + expert_start, tl.load(row + BINS) + real_rows


@triton.jit
def _chunk_scatter(ids_ptr, starts_ptr, totals_ptr, offsets_ptr, ok_ptr, eti_ptr, tim_ptr, LK, E, K, CHUNK, WIDTH,
                   BINS: tl.constexpr, SUB: tl.constexpr, CHECK_IDS: tl.constexpr):
    chunk = tl.program_id(0)
    bins = tl.arange(0, BINS)
    carry, sentinel_carry = _chunk_firsts(starts_ptr, totals_ptr, offsets_ptr, ok_ptr, E, chunk, WIDTH, BINS,
                                          CHECK_IDS)
    for s in range(0, CHUNK, SUB):
        rows = chunk * CHUNK + s + tl.arange(0, SUB)
        key = _keys(ids_ptr, rows, LK, E)
        hot = (key[:, None] == bins[None, :]).to(tl.int32)
        # Position = where the bin's rows of this step start + earlier rows of the step in the bin.
        pos = tl.sum(hot * (tl.cumsum(hot, axis=0) - 1 + carry[None, :]), axis=1)
        is_sentinel = (key == SENTINEL).to(tl.int32)
        pos = tl.where(is_sentinel != 0, sentinel_carry + tl.cumsum(is_sentinel, axis=0) - 1, pos)
        carry += tl.sum(hot, axis=0)
        sentinel_carry += tl.sum(is_sentinel, axis=0)
        valid = rows < LK
        tl.store(tim_ptr + rows, pos, mask=valid)
        tl.store(eti_ptr + pos, (rows // K).to(tl.int32), mask=valid)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _columns(key, BINS: tl.constexpr):
    """The table column of each key: its expert, BINS for sentinels, BINS + 1 for padding
    past LK (and negative ids)."""
    return tl.where(key == SENTINEL, BINS, tl.where(key < 0, BINS + 1, key))


@triton.jit
def _sorted_runs(ids_ptr, chunk, LK, E, CHUNK: tl.constexpr, BINS: tl.constexpr):
    """A chunk's rows sorted by (table column, row): each sorted slot's column (the expert,
    BINS for sentinels, BINS + 1 for padding past LK), its row, its rank inside its run of
    equal columns (= earlier rows of the chunk in that column), and whether it ends the run."""
    local = tl.arange(0, CHUNK)
    col = _columns(_keys(ids_ptr, chunk * CHUNK + local, LK, E), BINS)
    # Row numbers ride in the low bits, so the sort is stable in row order.
    packed = tl.sort(col * CHUNK + local)
    col = packed // CHUNK
    slot = tl.arange(0, CHUNK)
    before = tl.gather(col, tl.maximum(slot - 1, 0), 0)
    after = tl.gather(col, tl.minimum(slot + 1, CHUNK - 1), 0)
    starts = (slot == 0) | (before != col)
    run_start = tl.associative_scan(tl.where(starts, slot, 0), 0, _maximum)
    ends = (slot == CHUNK - 1) | (after != col)
    return col, chunk * CHUNK + packed % CHUNK, slot - run_start, ends


@triton.jit
def _run_flags(col, rows, rank, LK, K: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr):
    """``(negative, repeated)`` (0 or 1) read off a chunk's sorted runs, where every token's K
    rows lie inside the chunk: a row inside LK in the negative ids' column (BINS + 1), and
    a slot of a real expert's run whose row has the same token as the slot before it. A
    token's rows are consecutive, so two of them in one run sit side by side there; no id
    is loaded again."""
    negative = tl.max(((col == BINS + 1) & (rows < LK)).to(tl.int32), axis=0)
    previous = tl.gather(rows, tl.maximum(tl.arange(0, CHUNK) - 1, 0), 0)
    repeated = tl.max(((rank > 0) & (col < BINS) & (rows // K == previous // K)).to(tl.int32), axis=0)
    return negative, repeated


@triton.jit
def _chunk_histogram_sorted(ids_ptr, counts_ptr, ranked_ptr, LK, E, WIDTH, CHUNK: tl.constexpr, BINS: tl.constexpr,
                            K: tl.constexpr, CHECK_IDS: tl.constexpr, TOKENS: tl.constexpr):
    chunk = tl.program_id(0)
    row = counts_ptr + chunk * WIDTH
    tl.store(row + tl.arange(0, BINS), tl.zeros((BINS,), dtype=tl.int32))
    tl.store(row + BINS, 0)
    tl.debug_barrier()  # the zeros land before the runs' counts
    col, rows, rank, ends = _sorted_runs(ids_ptr, chunk, LK, E, CHUNK, BINS)
    # One writer per column. Negative ids and padding (column BINS + 1) write nothing: the
    # table's column BINS + 1 is the negative-id flag's when checking.
    tl.store(row + col, rank + 1, mask=ends & (col <= BINS))
    # Each row's column and rank, for the scatter, which then loads no id.
    tl.store(ranked_ptr + rows, col * CHUNK + rank, mask=rows < LK)
    if CHECK_IDS:
        if CHUNK % K == 0:
            negative, repeated = _run_flags(col, rows, rank, LK, K, CHUNK, BINS)
            tl.store(row + BINS + 1, negative)
            tl.store(row + BINS + 2, repeated)
        else:  # tokens straddle chunk edges: each chunk reads its own tokens' ids again
            _store_token_flags(ids_ptr, row + BINS + 1, chunk, CHUNK, LK, E, K, TOKENS)


@triton.jit
def _place_rows(first, sentinel_first, col, rows, rank, eti_ptr, tim_ptr, K, BINS: tl.constexpr):
    """Writes a sorted-chunk scatter's rows: each row (of table column ``col``, ``rank``-th
    of the chunk's rows in that column) goes to its column's first position in this chunk
    plus its rank; ``token_index_map`` gets the position, ``expert_token_indices`` the row's
    token. Padding and negative ids (columns past BINS) write nothing."""
    pos = tl.where(col == BINS, sentinel_first, tl.gather(first, tl.minimum(col, BINS - 1), 0)) + rank
    valid = col <= BINS
    tl.store(tim_ptr + rows, pos, mask=valid)
    tl.store(eti_ptr + pos, (rows // K).to(tl.int32), mask=valid)


@triton.jit
def _chunk_scatter_ranked(starts_ptr, totals_ptr, offsets_ptr, ok_ptr, eti_ptr, tim_ptr, LK, E, K, WIDTH,
                          CHUNK: tl.constexpr, BINS: tl.constexpr, CHECK_IDS: tl.constexpr):
    """The sorted-chunk scatter: each row's column and rank in its run are in ``tim_ptr``
    (``column * CHUNK + rank``, stored there by ``_chunk_histogram_sorted``), and are
    overwritten by the row's position."""
    chunk = tl.program_id(0)
    first, sentinel_first = _chunk_firsts(starts_ptr, totals_ptr, offsets_ptr, ok_ptr, E, chunk, WIDTH, BINS,
                                          CHECK_IDS)
    rows = chunk * CHUNK + tl.arange(0, CHUNK)
    ranked = tl.load(tim_ptr + rows, mask=rows < LK, other=(BINS + 1) * CHUNK)
    _place_rows(first, sentinel_first, ranked // CHUNK, rows, ranked % CHUNK, eti_ptr, tim_ptr, K, BINS)


@triton.jit
def _one_program_dispatch(ids_ptr, offsets_ptr, ok_ptr, eti_ptr, tim_ptr, LK, E, K: tl.constexpr,
                          CHUNK: tl.constexpr, BINS: tl.constexpr, HIST: tl.constexpr, CHECK_IDS: tl.constexpr):
    """A whole routing of at most ``CHUNK`` rows as one sorted chunk, in one program: the
    three steps without a table in memory. The runs give each row's rank in its column,
    a histogram of the columns (``HIST`` >= BINS + 2 bins: padding lands past BINS) the
    counts, and their cumulative sum where each expert's rows start."""
    chunk = tl.program_id(0)  # the only one
    col, rows, rank, ends = _sorted_runs(ids_ptr, chunk, LK, E, CHUNK, BINS)
    bins = tl.arange(0, HIST)
    counts = tl.where(bins < BINS, tl.histogram(col, HIST), 0)
    expert_start = tl.cumsum(counts, axis=0) - counts
    real_rows = tl.sum(counts, axis=0)
    tl.store(offsets_ptr + bins, expert_start, mask=bins < E)
    tl.store(offsets_ptr + E, real_rows)
    _place_rows(expert_start, real_rows, col, rows, rank, eti_ptr, tim_ptr, K, BINS)
    if CHECK_IDS:  # one chunk holds every token
        negative, repeated = _run_flags(col, rows, rank, LK, K, CHUNK, BINS)
        tl.store(ok_ptr, 1 - negative)
        tl.store(ok_ptr + 1, 1 - repeated)
        tl.store(ok_ptr + 2, (1 - negative) * (1 - repeated))


@triton.jit
def _check_index_arrays(eti_ptr, offsets_ptr, tim_ptr, ok_ptr, LK, E, L, BLOCK: tl.constexpr):
    """Each program writes 1 to its own flag when its slice of the arrays is valid: its
    rows' token ids in [0, L) and row numbers in [0, LK), its pairs of neighbouring offsets
    non-decreasing; program 0 also checks offsets[0] == 0 and offsets[E] <= LK."""
    pid = tl.program_id(0)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    inside = j < LK
    tok = tl.load(eti_ptr + j, mask=inside, other=0)
    row = tl.load(tim_ptr + j, mask=inside, other=0)
    bad = inside & ((tok < 0) | (tok >= L) | (row < 0) | (row >= LK))
    pair = j < E
    lo = tl.load(offsets_ptr + j, mask=pair, other=0)
    hi = tl.load(offsets_ptr + j + 1, mask=pair, other=0)
    bad = bad | (pair & (hi < lo))
    if pid == 0:
        bad = bad | ((j == 0) & ((tl.load(offsets_ptr) != 0) | (tl.load(offsets_ptr + E) > LK)))
    tl.store(ok_ptr + pid, 1 - tl.max(bad.to(tl.int32), axis=0))


def assert_index_arrays(op, expert_token_indices, expert_offsets, token_index_map, num_tokens):
    """Checks the values of the index arrays on the device (``torch._assert_async``: no host
    sync; a failure surfaces at the next synchronizing call, with ``index_values_message``)."""
    LK = token_index_map.shape[0]
    E = expert_offsets.shape[0] - 1
    BLOCK = 1024
    programs = max(1, gg.cdiv(max(LK, E), BLOCK))
    ok = torch.empty(programs, dtype=torch.int32, device=token_index_map.device)
    launch(_check_index_arrays, (programs,), expert_token_indices, expert_offsets, token_index_map, ok, LK, E,
           num_tokens, BLOCK=BLOCK)
    torch._assert_async(ok.amin(), index_values_message(op))


def _scan_tile(num_chunks: int, width: int, max_tile: int = SCAN_TILE) -> tuple[int, int, int]:
    """``(COLS, ROWS, num_warps)`` of ``_column_scan`` on a ``[num_chunks, width]`` table,
    a tile of at most ``max_tile`` elements (``SCAN_TILE``; tests shrink it, so that small
    tables take several steps).

    In a table of one block (``_scan_blocks``) a column is scanned by one program, top to
    bottom, and no program waits on another: only splitting the columns makes programs.
    Few columns per program make many of them: 4 (a row's load is still 16 contiguous
    bytes), 8 (32 bytes a row, a whole sector) where that still leaves a couple of
    programs per SM of a large GPU, or where the table is tall enough to be cut into
    blocks, whose programs are then many anyway. The rows come in the tallest
    power-of-two tile of at most ``max_tile`` elements, so a program walks its columns in
    few dependent steps; a full tile takes 8 warps, for more loads in flight and fewer
    registers a thread.
    """
    # 8 columns where even the tallest tile (4 columns) would leave the table in blocks.
    cols = 8 if _in_blocks(num_chunks, max_tile // 4) or gg.cdiv(width, 8) >= 256 else 4
    rows = min(max_tile // cols, max(64, gg.next_power_of_2(num_chunks)))
    return cols, rows, 8 if rows * cols >= max_tile else 4


def _in_blocks(num_chunks: int, rows: int) -> bool:
    """Whether a table of ``num_chunks`` rows, walked ``rows`` a step, is cut into blocks:
    one walk down it would take more than ``SCAN_STEPS`` steps."""
    return gg.cdiv(num_chunks, rows) > SCAN_STEPS


def _scan_blocks(num_chunks: int, rows: int) -> tuple[int, int]:
    """``(SPAN, blocks)``: the table rows each scan program walks, and how many blocks of
    them the table is cut into. A table of at most ``SCAN_STEPS`` tiles is one block, one
    pass; a taller one is cut into at most ``SCAN_BLOCKS`` blocks, each program walking
    its own, after a first pass has summed every block's columns: two launches, each of
    few dependent steps, where one walk down the whole table would take many."""
    steps = gg.cdiv(num_chunks, rows)
    if not _in_blocks(num_chunks, rows):
        return max(steps, 1) * rows, 1
    span = rows * gg.cdiv(steps, SCAN_BLOCKS)
    return span, gg.cdiv(num_chunks, span)


def _scan_columns(counts: torch.Tensor, totals: torch.Tensor, max_tile: int = SCAN_TILE):
    """Step 2 on a ``[num_chunks, width]`` int32 table: each column's exclusive prefix sum
    in place, and the column totals into ``totals`` (``_scan_tile``'s tile, in
    ``_scan_blocks``' blocks)."""
    num_chunks, width = counts.shape
    cols, rows, num_warps = _scan_tile(num_chunks, width, max_tile)
    span, blocks = _scan_blocks(num_chunks, rows)
    grid = (gg.cdiv(width, cols), blocks)
    sums = None
    if blocks > 1:
        sums = torch.empty(blocks, width, dtype=torch.int32, device=counts.device)
        launch(_column_block_sums, grid, counts, sums, num_chunks, width, span, COLS=cols, ROWS=rows,
               num_warps=num_warps)
    launch(_column_scan, grid, counts, totals, sums, num_chunks, width, span, COLS=cols, ROWS=rows,
           BLOCKS=gg.next_power_of_2(blocks), num_warps=num_warps)


def _chunk_size(LK: int) -> int:
    # Enough programs to fill the GPU, few enough chunks that the column scan stays short.
    return max(SUB, min(8192, gg.next_power_of_2(gg.cdiv(LK, 1024))))


def _dispatch(topk_ids: torch.Tensor, num_experts: int, check_ids: bool, scan_tile: int = SCAN_TILE):
    """``(expert_token_indices, expert_offsets, token_index_map, ok)``; ``ok`` (int32 ``[3]``,
    None without ``check_ids``) is 1 where no id is negative, where no token's row repeats
    a real expert id, and where both hold. ``scan_tile``: the column scan's largest tile (``_scan_tile``)."""
    L, K = topk_ids.shape
    LK = L * K
    dev = topk_ids.device
    E = num_experts
    BINS = gg.next_power_of_2(E)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    family = config.dispatch_family(LK, BINS)
    one_program = family == "one_program"
    sorted_ = family != "one_hot"
    if one_program:
        chunk = max(16, gg.next_power_of_2(LK))
    else:
        chunk = min(config.DISPATCH_SORT_CHUNK, max(16, gg.next_power_of_2(LK))) if sorted_ else _chunk_size(LK)
    if sorted_ and (BINS + 2) * chunk > 2**31:
        raise ValueError(f"dispatch: {E} experts are too many for sorted chunks of {chunk} rows")
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    eti = torch.empty(LK, dtype=torch.int32, device=dev)
    tim = torch.empty(LK, dtype=torch.int32, device=dev)
    ok = torch.empty(3, dtype=torch.int32, device=dev) if check_ids else None
    # K == 0 has no rows and no tokens to check; K is a constexpr (the unrolled pairs, the
    # chunks that hold whole tokens).
    check = dict(K=max(K, 1), CHECK_IDS=check_ids)
    if one_program:
        launch(_one_program_dispatch, (1,), ids, offsets, ok, eti, tim, LK, E, CHUNK=chunk, BINS=BINS,
               HIST=gg.next_power_of_2(BINS + 2), **check, num_warps=8 if chunk >= 1024 else 4)
        return eti, offsets, tim, ok
    check["TOKENS"] = min(128, gg.next_power_of_2(chunk // max(K, 1) + 1))
    num_chunks = max(1, gg.cdiv(LK, chunk))
    width = BINS + 3 if check_ids else BINS + 1  # the two flag columns after the sentinel column
    counts = torch.empty(num_chunks, width, dtype=torch.int32, device=dev)
    totals = torch.empty(width, dtype=torch.int32, device=dev)
    grid = (num_chunks,)
    if sorted_:
        # The histogram keeps each row's column and rank in token_index_map, which the
        # scatter then overwrites with the row's position: one sort per chunk, not two.
        launch(_chunk_histogram_sorted, grid, ids, counts, tim, LK, E, width, CHUNK=chunk, BINS=BINS, **check,
               num_warps=8)
    else:
        launch(_chunk_histogram, grid, ids, counts, LK, E, chunk, width, BINS=BINS, SUB=SUB, **check)
    _scan_columns(counts, totals, scan_tile)
    if sorted_:
        launch(_chunk_scatter_ranked, grid, counts, totals, offsets, ok, eti, tim, LK, E, K, width, CHUNK=chunk,
               BINS=BINS, CHECK_IDS=check_ids, num_warps=8)
    else:
        launch(_chunk_scatter, grid, ids, counts, totals, offsets, ok, eti, tim, LK, E, K, chunk, width, BINS=BINS,
               SUB=SUB, CHECK_IDS=check_ids)
    return eti, offsets, tim, ok


def dispatch(topk_ids: torch.Tensor, num_experts: int):
    """The index arrays of a routing (``moeblaze_ops.dispatch``), without the id checks."""
    return _dispatch(topk_ids, num_experts, check_ids=False)[:3]


def invalid_id_flags(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[negative, repeated]`` (int32, on the ids' device): 1 where some id is negative, where
    some token's row repeats a real expert id, as the checked dispatch finds them."""
    return 1 - _dispatch(topk_ids, num_experts, check_ids=True)[3][:2]


def dispatch_checked(topk_ids: torch.Tensor, num_experts: int):
    """``dispatch`` with the data checks of the ids made on the device, in the same launches:
    a bad id fails the next synchronizing call with the op's message. One assertion reads
    the flag of both checks (each is a kernel of its own in a decode step's graph);
    ``invalid_id_flags`` or the portable backend tell which failed."""
    eti, offsets, tim, ok = _dispatch(topk_ids, num_experts, check_ids=True)
    torch._assert_async(ok[2], id_values_message("dispatch"))
    return eti, offsets, tim
