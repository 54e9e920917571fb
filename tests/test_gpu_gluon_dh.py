"""The Gluon dH kernel (``kernels.triton_backend.gluon.dh``) on the GPU: every gradient of the layer
against the float64 reference with the kernel in the backward, over the activations, both
weight layouts, both 16-bit dtypes, ragged, empty and sentinel rows, odd sizes and E=256
K=8, dH written over h, other tiles and fewer chunks of h in flight, with a count of its
launches so that a test cannot pass on the portable kernel alone (``check_backward`` also
runs every backward twice and wants the gradients bitwise equal)."""

import pytest
import torch

from kernel_cases import check_backward
from moeblaze_ops import settings
from moeblaze_ops.kernels import config
from moeblaze_ops.kernels.config import GemmTile


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a capability 9 GPU")]


@pytest.fixture(autouse=True)
def gluon_dh_on(monkeypatch):
    """dH on its Gluon kernel: with ``config.SMALL_GEMM_FLOP`` 0 it runs at these tests'
    sizes too."""
    monkeypatch.setattr(config, "SMALL_GEMM_FLOP", 0)
    with settings.override(poison=True):
        yield


@pytest.fixture
def launches(monkeypatch):
    """How many times the Gluon dH kernel was launched."""
    from moeblaze_ops.kernels.triton_backend.gluon import dh as gluon_dh

    count = [0]
    launch = gluon_dh.launch_dh

    def counted(*args, **kwargs):
        count[0] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(gluon_dh, "launch_dh", counted)
    return count


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation,layout", [("swiglu", "concatenated"), ("clamped_swiglu", "transposed"),
                                               ("geglu", "concatenated"), ("gelu", "transposed"),
                                               ("silu", "concatenated")])
def test_gluon_dh_backward(activation, layout, dtype, seed, launches):
    """Every activation (the approximate sigmoid where it takes one), both layouts the
    kernel takes, both 16-bit dtypes."""
    check_backward(777, 256, 192, 8, 2, dtype=dtype, device="cuda", seed=seed, activation=activation,
                   layout=layout, tw_dtype=torch.float32)
    assert launches[0] > 0


@pytest.mark.parametrize("L,d,I,E,K,routing,sentinel_frac", [
    (2048, 256, 128, 16, 2, "skewed", 0.0),
    (2048, 256, 128, 8, 1, "first", 0.0),  # every row on one expert
    (2048, 256, 128, 9, 2, "no_last", 0.0),  # an empty expert
    (2048, 256, 128, 256, 8, "uniform", 0.0),
    (1, 256, 128, 8, 2, "uniform", 0.0),
    (1024, 256, 128, 8, 2, "uniform", 0.3),  # sentinel rows
    (777, 2880, 1408, 8, 2, "uniform", 0.0),  # I = 11 tiles of 128, d = 45 steps of 64
    (777, 512, 208, 8, 2, "uniform", 0.0),  # a partial last tile: one half inside I, one past it
    (777, 512, 176, 8, 2, "uniform", 0.0),  # a partial last tile: both halves partly inside I
    (4096, 1024, 512, 4, 2, "uniform", 0.0),  # many tiles per program: the held ring slot goes round
    (4096, 512, 320, 4, 2, "uniform", 0.0),  # a last tile of one part inside I
])
def test_gluon_dh_routings_and_sizes(L, d, I, E, K, routing, sentinel_frac, seed, launches):
    check_backward(L, d, I, E, K, dtype=torch.bfloat16, device="cuda", seed=seed, routing=routing,
                   sentinel_frac=sentinel_frac, layout="transposed" if E == 256 else "concatenated")
    assert launches[0] > 0


@pytest.mark.parametrize("layout", ["concatenated", "transposed"])
def test_gluon_dh_recompute(layout, seed, launches):
    """dH written over h (``recompute=True`` hands the kernel the h it has just recomputed)."""
    check_backward(777, 256, 192, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout=layout,
                   tw_dtype=torch.float32, recompute=True)
    assert launches[0] > 0


@pytest.mark.parametrize("layout,bias", [("interleaved", False), ("concatenated", True)])
def test_gluon_dh_leaves_other_cases_to_the_portable_kernel(layout, bias, seed, launches):
    """An interleaved h or a down bias takes the portable kernel, with the same results."""
    check_backward(777, 256, 192, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout=layout, bias=bias,
                   tw_dtype=torch.float32)
    assert launches[0] == 0


@pytest.mark.parametrize("slots", [1, 3])
def test_gluon_dh_h_slots(slots, seed, launches, monkeypatch):
    """Fewer chunks of h in flight than shared memory holds: one (each chunk's copies
    waited for before the next is started), and a count that does not divide the tile's
    chunks (the ring wraps mid-part)."""
    from moeblaze_ops.kernels.triton_backend.gluon import dh as gluon_dh

    launch = gluon_dh.launch_dh
    monkeypatch.setattr(gluon_dh, "launch_dh", lambda *args, **kwargs: launch(*args, **kwargs, slots=slots))
    check_backward(777, 512, 320, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout="concatenated",
                   tw_dtype=torch.float32)
    assert launches[0] > 0


@pytest.mark.parametrize("tile", [
    GemmTile(128, 128, 64, 8, 4),  # the fp32 stage in shared memory of its own: a W_down slot is too small
    GemmTile(128, 256, 64, 8, 3),  # a ring of 3 slots: more chunks of h in flight than the tile's parts
    GemmTile(64, 128, 64, 4, 4),  # one MMA warpgroup, its chunks over two passes of its warps
], ids=str)
def test_gluon_dh_other_tiles(tile, seed, launches):
    with settings.override(tiles={**settings.current().tiles, "dh": tile}):
        check_backward(777, 512, 320, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout="concatenated",
                       tw_dtype=torch.float32, sentinel_frac=0.2)
    assert launches[0] > 0
