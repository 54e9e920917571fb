"""moeblaze.dispatch against a numpy stable-argsort construction, and its invariants."""

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
