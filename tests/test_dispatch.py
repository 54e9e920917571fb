"""moeblaze.dispatch against a numpy stable-argsort construction, and its invariants; the
Triton dispatch's column scan (step 2) in tiles of several programs and steps."""

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeblaze_ops.testing import make_topk_ids


def argsort_dispatch(topk_ids, E):
    """The definition, built with numpy's stable argsort (sentinels collapsed to E)."""
    ids = topk_ids.numpy().astype(np.int64)
    L, K = ids.shape
    key = np.minimum(ids.reshape(-1), E)
    order = np.argsort(key, kind="stable")
    counts = np.bincount(key, minlength=E + 1)[:E]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    tim = np.empty(L * K, dtype=np.int64)
    tim[order] = np.arange(L * K)
    return order // max(K, 1), offsets, tim


def check_dispatch(topk_ids, E):
    eti, offsets, tim = torch.ops.moeblaze.dispatch(topk_ids, E)
    L, K = topk_ids.shape
    for t, n in ((eti, L * K), (offsets, E + 1), (tim, L * K)):
        assert t.dtype == torch.int32 and t.shape == (n,)
    want_eti, want_offsets, want_tim = argsort_dispatch(topk_ids, E)
    np.testing.assert_array_equal(eti.numpy(), want_eti)
    np.testing.assert_array_equal(offsets.numpy(), want_offsets)
    np.testing.assert_array_equal(tim.numpy(), want_tim)

    # Invariants, stated without the construction above.
    flat = topk_ids.reshape(-1).long()
    real = flat < E
    assert offsets[0] == 0
    assert torch.equal(offsets.diff().long(), torch.bincount(flat[real], minlength=E)[:E])
    assert offsets[E] == int(real.sum())
    assert torch.equal(tim.long().sort().values, torch.arange(L * K))  # a permutation
    rows = tim.long()
    assert torch.equal(eti.long()[rows], torch.arange(L * K) // max(K, 1))  # inverse of the grouping
    row_expert = torch.searchsorted(offsets.long(), rows, right=True) - 1
    assert torch.equal(row_expert[real], flat[real])  # each choice sits in its expert's range
    assert bool((rows[~real] >= offsets[E]).all())  # sentinels after the last expert
    for e in range(E):
        tokens = eti[offsets[e]:offsets[e + 1]].long()
        assert bool((tokens.diff() > 0).all())  # ascending token order inside an expert


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "L,K,E,routing,sentinel_frac",
    [
        (33, 2, 8, "uniform", 0.0),
        (1, 1, 1, "uniform", 0.0),
        (1, 4, 8, "uniform", 0.0),
        (40, 1, 1, "uniform", 0.0),
        (25, 3, 5, "first", 0.0),
        (50, 2, 6, "no_last", 0.0),
        (64, 4, 16, "skewed", 0.0),
        (30, 3, 6, "uniform", 0.3),
        (12, 2, 4, "uniform", 1.0),
        (256, 8, 256, "uniform", 0.0),
    ],
)
def test_dispatch_matches_stable_argsort(L, K, E, routing, sentinel_frac, dtype, seed):
    ids = make_topk_ids(L, K, E, routing, sentinel_frac=sentinel_frac, dtype=dtype,
                        generator=torch.Generator().manual_seed(seed))
    check_dispatch(ids, E)


def test_dispatch_empty():
    eti, offsets, tim = torch.ops.moeblaze.dispatch(torch.empty(0, 2, dtype=torch.int64), 4)
    assert eti.shape == (0,) and tim.shape == (0,)
    assert torch.equal(offsets, torch.zeros(5, dtype=torch.int32))


@settings(max_examples=60, deadline=None)
@given(
    L=st.integers(1, 40),
    E=st.integers(1, 12),
    data=st.data(),
)
def test_dispatch_property(L, E, data):
    K = data.draw(st.integers(1, E))
    rows = [data.draw(st.permutations(range(E + 2)))[:K] for _ in range(L)]
    # Ids E and E+1 are sentinels; a row may hold several of them.
    check_dispatch(torch.tensor(rows, dtype=torch.int64), E)


def triton_device():
    """Where the Triton kernels run: CPU tensors under the interpreter (set by conftest on
    machines without CUDA), else the GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return "cuda"


@settings(max_examples=300, deadline=None)
@given(num_chunks=st.integers(1, 2**20), width=st.integers(2, 2**14 + 3))
def test_scan_tile(num_chunks, width):
    """The column scan's tile covers every column, fits ``SCAN_TILE``, is a power of two
    tall and as tall as the table when the tile allows; few columns a program, so the
    scan runs as many programs as 4 columns each make, up to 64 at least, or the table is
    tall and cut into blocks of whole 8-column sectors a row."""
    from moeblaze_ops.kernels.triton_backend.grouped_gemm import cdiv
    from moeblaze_ops.kernels.triton_backend.dispatch import SCAN_TILE, _scan_blocks, _scan_tile

    cols, rows, num_warps = _scan_tile(num_chunks, width)
    programs = cdiv(width, cols)
    blocks = _scan_blocks(num_chunks, rows)[1]
    assert cols in (4, 8) and num_warps in (4, 8)
    assert programs * cols >= width
    assert programs >= min(64, cdiv(width, 4)) or (cols == 8 and blocks > 1)
    assert rows & (rows - 1) == 0 and rows * cols <= SCAN_TILE
    assert rows >= min(num_chunks, SCAN_TILE // cols)


@settings(max_examples=300, deadline=None)
@given(num_chunks=st.integers(1, 2**22), rows=st.sampled_from([8, 64, 512, 1024]))
def test_scan_blocks(num_chunks, rows):
    """The scan's blocks cover the table once, in whole tiles: one block where a program
    walks few tiles, else at most ``SCAN_BLOCKS`` blocks, the last one not empty."""
    from moeblaze_ops.kernels.triton_backend.grouped_gemm import cdiv
    from moeblaze_ops.kernels.triton_backend.dispatch import SCAN_BLOCKS, SCAN_STEPS, _scan_blocks

    span, blocks = _scan_blocks(num_chunks, rows)
    assert span % rows == 0 and (blocks - 1) * span < num_chunks <= blocks * span
    assert blocks == 1 if cdiv(num_chunks, rows) <= SCAN_STEPS else 1 < blocks <= SCAN_BLOCKS


@pytest.mark.parametrize(
    "num_chunks,width,max_tile",
    [(1, 2, None), (64, 35, None), (1024, 19, None), (2500, 259, None), (600, 2049, None), (600, 19, 32),
     (160, 19, 128), (32, 35, 32)],
    ids=["one_row", "one_step", "one_tall_step", "ragged_steps_4_cols", "ragged_steps_8_cols", "blocks_ragged",
         "blocks_of_one_step", "one_block_of_most_steps"],
)
def test_column_scan(num_chunks, width, max_tile, seed):
    """``_scan_columns`` against torch: each column's exclusive prefix sum in place and its
    total. The ragged tables take several programs, several steps each, and end in a part
    block of rows and of columns; with a small tile the tall ones are scanned in blocks of
    8 columns (50 of 12 rows; 10 of one 16-row step), each started from the blocks above
    it, or in one block of ``SCAN_STEPS`` steps."""
    from moeblaze_ops.kernels.triton_backend.dispatch import SCAN_TILE, _scan_columns

    dev = triton_device()
    counts = torch.randint(0, 1000, (num_chunks, width), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(seed))
    want = counts.cumsum(0, dtype=torch.int32) - counts
    want_totals = counts.sum(0, dtype=torch.int32)
    got = counts.to(dev)
    totals = torch.full((width,), -1, dtype=torch.int32, device=dev)
    _scan_columns(got, totals, max_tile or SCAN_TILE)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(totals.cpu(), want_totals)


@pytest.mark.parametrize("scan_tile", [32, 16], ids=["one_block", "blocks"])
@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize(
    "L,K,E,family",
    [(40, 8, 256, dict(DISPATCH_SORTED_MIN_BINS=1, DISPATCH_SORT_CHUNK=16, DISPATCH_ONE_PROGRAM_MAX_ROWS=-1)),
     (400, 3, 6, dict(DISPATCH_SORTED_MIN_BINS=2**31, DISPATCH_ONE_PROGRAM_MAX_ROWS=-1))],
    ids=["sorted16", "onehot"],
)
def test_triton_dispatch_scan_in_steps(L, K, E, family, checked, scan_tile, seed, monkeypatch):
    """The Triton dispatch with its column scan in several programs of several steps, the
    last block of rows and of columns part-filled, against the portable dispatch bit for
    bit: a small scan tile (8 rows of 4 columns; or 16 elements, 2 rows of 8 columns, so
    that the table is scanned in blocks) does to tables of 20 and 19 chunks (16-row sorted
    chunks of 256 experts: 257 or 259 columns; 64-row one-hot chunks of 6 experts: 9 or
    11) what the real one does to thousands. ``family``: the constants of
    ``config.dispatch_family`` that send these small routings to each kernel family.
    Checked, the id flags say the ids are valid."""
    from moeblaze_ops.kernels import config
    from moeblaze_ops.kernels.torch_backend import dispatch as torch_dispatch
    from moeblaze_ops.kernels.triton_backend import dispatch as triton_dispatch

    for name, value in family.items():
        monkeypatch.setattr(config, name, value)
    ids = make_topk_ids(L, K, E, "skewed", sentinel_frac=0.1, generator=torch.Generator().manual_seed(seed))
    *got, ok = triton_dispatch._dispatch(ids.to(triton_device()), E, check_ids=checked, scan_tile=scan_tile)
    for g, w in zip(got, torch_dispatch.dispatch(ids, E)):
        assert torch.equal(g.cpu(), w)
    assert (ok is None) != checked and (not checked or ok.cpu().tolist() == [1, 1, 1])
