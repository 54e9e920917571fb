"""The Triton forward kernels, run by Triton's interpreter on CPU tensors at tiny sizes."""

import os

import hypothesis
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

from kernel_cases import check_backward, check_dispatch_bitwise, check_forward, check_frozen_grads
from conftest import make_layer, rel_err
from moeblaze_ops import ACTIVATIONS, moe_experts, settings
from moeblaze_ops.kernels import config
from moeblaze_ops.kernels.config import GemmTile
from moeblaze_ops.kernels.triton_backend import grouped_gemm as gg

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 (set by conftest on machines without CUDA)")


@pytest.fixture(autouse=True)
def triton_on_cpu():
    with settings.override(backend="triton", poison=True):
        yield


@pytest.mark.parametrize(
    "L,K,E,routing,sentinel_frac",
    [(33, 2, 8, "uniform", 0.0), (1, 1, 1, "uniform", 0.0), (200, 8, 64, "skewed", 0.1), (50, 3, 6, "first", 0.4),
     (40, 2, 6, "no_last", 0.0), (3000, 4, 16, "uniform", 0.0)],
)
def test_dispatch_kernel_bitwise(L, K, E, routing, sentinel_frac, seed):
    check_dispatch_bitwise(L, K, E, device="cpu", routing=routing, sentinel_frac=sentinel_frac, seed=seed)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_forward_kernels(activation, layout, seed):
    """The up GEMM, the activation pass, the down GEMM on its output and the combine."""
    check_forward(24, 20, 12, 4, 2, dtype=torch.float32, device="cpu", seed=seed, activation=activation,
                  layout=layout, bias=layout != "concatenated")


@pytest.mark.parametrize("differentiated,up_epilogue", [(False, True), (False, False), (True, False)],
                         ids=["no_grad", "no_grad_activation_pass", "training"])
@pytest.mark.parametrize("activation,layout", [("swiglu", "concatenated"), ("clamped_swiglu", "transposed_interleaved"),
                                               ("geglu", "interleaved"), ("gelu", "transposed")])
def test_forward_activation_routes(activation, layout, differentiated, up_epilogue, seed, monkeypatch):
    """The forward's routes: without gradients the up projection returns act(h), from the
    ``tl`` up GEMM's activation epilogue (small GEMMs, ``config.activates_in_up_epilogue``;
    the activation pass must not run) or from the up GEMM then the activation pass (larger
    ones, where no Gluon kernel runs); for training it returns h, kept for backward, and the
    down projection activates it; against the reference."""
    from moeblaze_ops.kernels.triton_backend import experts as triton_experts

    monkeypatch.setattr(config, "activates_in_up_epilogue", lambda flop: up_epilogue)
    if up_epilogue:
        monkeypatch.setattr(triton_experts, "launch_activation", _must_not_run("the activation pass"))
    check_forward(24, 20, 12, 4, 2, dtype=torch.float32, device="cpu", seed=seed, activation=activation,
                  layout=layout, bias=layout != "concatenated", differentiated=differentiated)


def _must_not_run(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran")
    return fail


@pytest.mark.parametrize("activation,layout", [("swiglu", "concatenated"), ("clamped_swiglu", "transposed_interleaved"),
                                               ("gelu", "concatenated")])
@pytest.mark.parametrize("sentinel_frac", [0.0, 0.3])
def test_up_with_activation_always(activation, layout, sentinel_frac, seed):
    """``expert_up_with_activation`` (what a compiled graph that planned for
    act(h) beside h calls; here, without a Gluon kernel, the GEMM then the activation pass):
    h and act(h) against the float64 portable kernels', where the rule
    (``config.activation_beside_h``) would not make act(h)."""
    from moeblaze_ops.kernels.torch_backend import experts as torch_experts
    from moeblaze_ops.kernels.triton_backend import experts as triton_experts

    layer = make_layer(40, 20, 12, 4, 2, seed=seed, activation=activation, layout=layout, bias=True,
                       sentinel_frac=sentinel_frac)
    eti, offsets, tim = torch.ops.moeblaze.dispatch(layer["topk_ids"], 4)

    def up(kernels, dtype):
        t = {k: layer[k].to(dtype) for k in ("x", "w_gate_up", "b_gate_up")}
        return kernels.expert_up_with_activation(t["x"], t["w_gate_up"], eti, offsets, tim, t["b_gate_up"],
                                                 layer["transposed"], activation, layer["interleaved"], 1.702, 7.0)

    assert not config.activation_beside_h(12, 80, 4)
    h, a = up(triton_experts, torch.float32)
    h_ref, a_ref = up(torch_experts, torch.float64)
    assert rel_err(h, h_ref) < 1e-5 and rel_err(a, a_ref) < 1e-5


@pytest.mark.parametrize(
    "L,E,K,routing,sentinel_frac",
    [(1, 4, 2, "uniform", 0.0), (30, 4, 1, "first", 0.0), (30, 5, 2, "no_last", 0.0), (30, 4, 2, "skewed", 0.3),
     (12, 16, 8, "uniform", 0.0)],
)
def test_forward_routings(L, E, K, routing, sentinel_frac, seed):
    check_forward(L, 18, 10, E, K, dtype=torch.float32, device="cpu", seed=seed, routing=routing,
                  sentinel_frac=sentinel_frac, bias=True)


_SWIGLU = dict(activation="swiglu")
_CLAMPED = dict(activation="clamped_swiglu", layout="transposed_interleaved", bias=True)
_GELU_SENTINELS = dict(activation="gelu", sentinel_frac=0.25)


@pytest.mark.parametrize("T,case,differentiated", [
    (1, _SWIGLU, False), (2, _CLAMPED, True), (3, _GELU_SENTINELS, False), (13, _SWIGLU, True),
    (37, _CLAMPED, False), (64, _GELU_SENTINELS, True)])
@pytest.mark.parametrize("rows_class", ["few_rows", "some_rows"])
def test_decode_tiles(T, case, differentiated, rows_class, seed):
    """The decode tiles of the up and down GEMMs (``TILE_TABLE``'s rows classes; CPU tensors
    take the interpreter's tile, so the test names them) on the interpreter at decode token
    counts, powers of two or not: gated and plain activations, both layouts, biases and
    sentinel ids, without and with gradients, against the float64 reference."""
    tile = config.TILE_TABLE[("up", "16bit", "sm90", rows_class)][0]
    assert tile == config.TILE_TABLE[("down", "16bit", "sm90", rows_class)][0]
    with settings.override(tiles={"up": tile, "down": tile}):
        check_forward(T, 20, 12, 8, 2, dtype=torch.float32, device="cpu", seed=seed, differentiated=differentiated,
                      **case)


def test_forward_half(seed):
    check_forward(24, 16, 16, 4, 2, dtype=torch.float16, device="cpu", seed=seed, tw_dtype=torch.float32)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_backward_kernels(activation, layout, seed):
    check_backward(24, 20, 12, 4, 2, dtype=torch.float32, device="cpu", seed=seed, activation=activation,
                   layout=layout, bias=layout != "concatenated")


@pytest.mark.parametrize("block_n,slices", [(128, 2), (256, 4)])
@pytest.mark.parametrize("activation,layout", [("swiglu", "concatenated"), ("clamped_swiglu", "transposed_interleaved"),
                                               ("gelu", "concatenated")])
def test_dh_epilogue_slices(activation, layout, block_n, slices, seed):
    """The dH epilogue in column slices of ``config.DH_EPILOGUE_COLUMNS``: 2 and 4 slices
    of a 128- and a 256-column "dh" tile (the interpreter's own 16-column tile takes one),
    with I = 40 (a partial tile, slices past I); with 4 slices in place over recomputed h."""
    tile = GemmTile(16, block_n, 16, 4, 1)
    assert config.dh_epilogue_slices(tile.block_n) == slices
    with settings.override(tiles={"dh": tile}):
        check_backward(30, 16, 40, 3, 2, dtype=torch.float32, device="cpu", seed=seed, activation=activation,
                       layout=layout, bias=True, recompute=slices == 4)


@pytest.mark.parametrize(
    "L,E,K,routing,sentinel_frac",
    [(1, 4, 2, "uniform", 0.0), (30, 4, 1, "first", 0.0), (30, 5, 2, "no_last", 0.0), (30, 4, 2, "skewed", 0.3)],
)
def test_backward_routings(L, E, K, routing, sentinel_frac, seed):
    check_backward(L, 18, 10, E, K, dtype=torch.float32, device="cpu", seed=seed, routing=routing,
                   sentinel_frac=sentinel_frac, bias=True)


@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_backward_whole_steps(layout, seed):
    """Experts with several whole 16-row reduction steps plus a ragged last one."""
    check_backward(45, 16, 8, 2, 2, dtype=torch.float32, device="cpu", seed=seed, layout=layout, bias=True,
                   routing="skewed")


@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_recompute_backward_kernels(layout, seed):
    """recompute=True: h recomputed in backward and dH written over it in place."""
    check_backward(45, 16, 8, 3, 2, dtype=torch.float32, device="cpu", seed=seed, layout=layout,
                   bias=layout != "concatenated", recompute=True)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("trainable", [("x", "topk_weights"), ("w_gate_up", "w_down", "b_gate_up", "b_down")])
def test_backward_kernels_skip_frozen(trainable, recompute, seed):
    check_frozen_grads(20, 16, 8, 3, 2, trainable=trainable, dtype=torch.float32, device="cpu", seed=seed,
                       recompute=recompute)


#: The dispatch kernel families of several chunks, as the constants of
#: ``config.dispatch_family`` that put these small routings in them: one-hot tiles (chunks
#: of 64 rows at these sizes), sorted chunks of 16 rows (many chunk edges) and of 128
#: (padding past the last row); none of these routings goes to one program.
DISPATCH_FAMILIES = {"onehot": dict(DISPATCH_SORTED_MIN_BINS=2**31, DISPATCH_ONE_PROGRAM_MAX_ROWS=-1),
                     "sorted16": dict(DISPATCH_SORTED_MIN_BINS=1, DISPATCH_SORT_CHUNK=16,
                                      DISPATCH_ONE_PROGRAM_MAX_ROWS=-1),
                     "sorted128": dict(DISPATCH_SORTED_MIN_BINS=1, DISPATCH_SORT_CHUNK=128,
                                       DISPATCH_ONE_PROGRAM_MAX_ROWS=-1)}
#: The whole routing as one sorted chunk in one program (the rule's default at these sizes).
ONE_PROGRAM = {"one_program": {}}


def _use_dispatch_family(monkeypatch, constants):
    """Puts the dispatch rule's ``constants`` (a ``DISPATCH_FAMILIES`` entry) in force for the test."""
    for name, value in constants.items():
        monkeypatch.setattr(config, name, value)


def _check_id_flags(ids, E):
    """The id flags of the checked dispatch against a plain Python reading of the ids."""
    from moeblaze_ops.kernels.triton_backend.dispatch import invalid_id_flags

    rows = ids.tolist()
    expected = [int(any(i < 0 for r in rows for i in r)),
                int(any(len([i for i in r if 0 <= i < E]) != len({i for i in r if 0 <= i < E}) for r in rows))]
    assert invalid_id_flags(ids, E).tolist() == expected


@pytest.mark.parametrize("family", {**DISPATCH_FAMILIES, **ONE_PROGRAM})
@pytest.mark.parametrize("K", [1, 2, 3, 8])
@pytest.mark.parametrize("defect", ["none", "negative", "repeat", "repeated_sentinel", "both"])
def test_invalid_id_flags(K, defect, family, seed, monkeypatch):
    """The CUDA path's id check (folded into the dispatch kernels of either family) against
    a plain Python reading of the ids."""
    from conftest import make_topk_ids

    g = torch.Generator().manual_seed(seed)
    E, L = 9, 70 if family == "onehot" else 35  # sorting is slow in the interpreter
    ids = make_topk_ids(L, K, E, generator=g)
    row = int(torch.randint(0, L, (1,), generator=g))
    if defect in ("negative", "both"):
        ids[row, 0] = -1
    if defect in ("repeat", "both") and K > 1:
        ids[(row + 1) % L, K - 1] = ids[(row + 1) % L, 0].clamp(min=0)
    if defect == "repeated_sentinel" and K > 1:
        ids[row, :2] = E + 1  # sentinels may repeat
    _use_dispatch_family(monkeypatch, {**DISPATCH_FAMILIES, **ONE_PROGRAM}[family])
    _check_id_flags(ids, E)
    if defect == "repeated_sentinel":  # valid ids: the checked dispatch's arrays are the portable one's
        from moeblaze_ops.kernels.torch_backend import dispatch as torch_dispatch
        from moeblaze_ops.kernels.triton_backend import dispatch as triton_dispatch

        for got, want in zip(triton_dispatch.dispatch_checked(ids, E), torch_dispatch.dispatch(ids, E)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("family", DISPATCH_FAMILIES)
@pytest.mark.parametrize("K,dtype", [(3, torch.int64), (5, torch.int32)])
@pytest.mark.parametrize("defect", ["negative", "repeat"])
def test_invalid_id_flags_straddling_token(K, dtype, defect, family, seed, monkeypatch):
    """A defect in the token whose K rows cross the first chunk edge, its bad id past the
    edge: the chunk of the token's first row reads on into the next chunk and flags it, and
    dispatch_checked fails with the op's message."""
    import re

    from conftest import make_topk_ids
    from moeblaze_ops.checks import id_values_message
    from moeblaze_ops.kernels.triton_backend.dispatch import _chunk_size, dispatch_checked

    E, L = 9, 70
    ids = make_topk_ids(L, K, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    edge = DISPATCH_FAMILIES[family].get("DISPATCH_SORT_CHUNK") or _chunk_size(L * K)
    token = edge // K
    assert token * K < edge < (token + 1) * K < L * K
    ids[token, K - 1] = -1 if defect == "negative" else ids[token, 0]
    _use_dispatch_family(monkeypatch, DISPATCH_FAMILIES[family])
    _check_id_flags(ids, E)
    with pytest.raises(RuntimeError, match=re.escape(id_values_message("dispatch"))):
        dispatch_checked(ids, E)


@pytest.mark.parametrize("weights", ["tma", "pointer"])
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_kernels_with_weight_tma(layout, weights, seed, monkeypatch):
    """Weight tiles through 3-D TMA descriptors in every GEMM that reads them so
    (``config.WEIGHT_TMA_KINDS``: up, dH, dX; these GEMMs count as large with
    ``SMALL_GEMM_FLOP`` 0), or by pointer (small GEMMs, the rule's default at these sizes):
    forward and backward against the reference, with tiles running past each expert's
    weight edges."""
    from moeblaze_ops.kernels.triton_backend import grouped_gemm

    if weights == "tma":
        monkeypatch.setattr(config, "SMALL_GEMM_FLOP", 0)
    read = []  # (kind, through TMA) of every weight operand made
    operand = grouped_gemm.weight_operand

    def recording(w, stride_reduction, tile, kind, flop):
        made = operand(w, stride_reduction, tile, kind, flop)
        read.append((kind, made[1]))
        return made

    monkeypatch.setattr(grouped_gemm, "weight_operand", recording)
    check_forward(24, 20, 12, 4, 2, dtype=torch.float32, device="cpu", seed=seed, layout=layout, bias=True)
    check_backward(45, 20, 12, 3, 2, dtype=torch.float32, device="cpu", seed=seed, layout=layout, bias=True)
    assert {kind for kind, _ in read} == {"up", "down", "dh", "dx"}
    assert all(tma == (weights == "tma" and kind in config.WEIGHT_TMA_KINDS) for kind, tma in read), read


@pytest.mark.parametrize("mode,most", [({"overwrite_h": False}, 2), ({}, 1), ({"recompute": True}, 1)])
def test_live_h_sized_buffers(mode, most, seed, monkeypatch):
    """How many [L*K, N] buffers (h, dH) the kernels hold at once in a forward + backward:
    one in the default and recompute modes (dH written over h), two with overwrite_h=False."""
    import weakref

    from moeblaze_ops.kernels.triton_backend import grouped_gemm

    L, d, I, E, K = 40, 12, 8, 3, 2  # d != 2I: no other buffer has h's shape
    count = {"live": 0, "most": 0}
    allocate = grouped_gemm.empty

    def tracked(*shape, dtype, device):
        t = allocate(*shape, dtype=dtype, device=device)
        if tuple(shape) == (L * K, 2 * I):
            count["live"] += 1
            count["most"] = max(count["most"], count["live"])
            weakref.finalize(t, lambda: count.__setitem__("live", count["live"] - 1))
        return t

    monkeypatch.setattr(grouped_gemm, "empty", tracked)  # every Triton kernel allocates through it
    layer = make_layer(L, d, I, E, K, seed=seed, requires_grad=True)
    moe_experts(**layer, **mode).square().sum().backward()
    assert layer["x"].grad is not None and count["most"] == most


@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_up_weight_gradient_and_dx_scratch_never_coexist(layout, seed, monkeypatch):
    """The backward of the up projection makes dX (its [L*K, slab] scratch) before it
    allocates the [E, 2I, d] weight gradient: the two are never alive at once, so the
    scratch is not part of the step's peak."""
    import weakref

    from moeblaze_ops.kernels.triton_backend import grouped_gemm

    L, d, I, E, K = 40, 12, 8, 3, 2  # d != I, 2I: the scratch [L*K, d] has a shape of its own
    layer = make_layer(L, d, I, E, K, seed=seed, requires_grad=True, layout=layout)
    kinds = {tuple(layer["w_gate_up"].shape): "grad_w", (L * K, d): "scratch"}
    live = {"grad_w": 0, "scratch": 0}
    overlaps = []
    allocate = grouped_gemm.empty

    def tracked(*shape, dtype, device):
        t = allocate(*shape, dtype=dtype, device=device)
        kind = kinds.get(tuple(shape))
        if kind is not None:
            live[kind] += 1
            overlaps.append(live["grad_w"] > 0 and live["scratch"] > 0)
            weakref.finalize(t, lambda: live.__setitem__(kind, live[kind] - 1))
        return t

    monkeypatch.setattr(grouped_gemm, "empty", tracked)  # every Triton kernel allocates through it
    moe_experts(**layer).square().sum().backward()
    assert layer["w_gate_up"].grad is not None and layer["x"].grad is not None
    assert overlaps.count(False) >= 3 and not any(overlaps), overlaps  # forward scratch, dX scratch, grad_w


@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_column_slabs(layout, seed, monkeypatch):
    """The [L*K, d] scratch made in column slabs (``settings.column_slab``; d = 20 in
    slabs of 8, 8, 4: 200 routed rows over 2 experts leave the weight gradients' bytes no
    room to widen them): forward and every gradient against the reference, and the slabs
    the kernels made are those."""
    from moeblaze_ops.kernels.triton_backend import combine as triton_combine

    made = []
    real = triton_combine.column_slabs
    monkeypatch.setattr(triton_combine, "column_slabs", lambda d, widest=0: made.append(real(d, widest)) or made[-1])
    with settings.override(column_slab=8):
        assert real(20) == [(0, 8), (8, 16), (16, 20)]
        check_forward(100, 20, 12, 2, 2, dtype=torch.float32, device="cpu", seed=seed, layout=layout, bias=True)
        check_backward(100, 20, 12, 2, 2, dtype=torch.float32, device="cpu", seed=seed, layout=layout, bias=True,
                       routing="skewed", sentinel_frac=0.2)
    assert made and all(slabs == [(0, 8), (8, 16), (16, 20)] for slabs in made), made


@pytest.mark.parametrize("differentiated", [False, True])
def test_down_slabs_widen_in_training_alone(differentiated, seed, monkeypatch):
    """Where act(h) alone passes the weight gradients' bound (200 routed rows of act(h) 12
    wide against down weights of 480 elements), the training forward's down projection may
    still widen its scratch to the down weights' bytes (480 / 200: 2 columns), the forward
    without gradients may not (``widest`` 0): the slabs the kernels made, and the output
    against the reference either way."""
    from moeblaze_ops.kernels.triton_backend import combine as triton_combine

    widest = []
    real = triton_combine.column_slabs
    monkeypatch.setattr(triton_combine, "column_slabs", lambda d, w=0: widest.append(w) or real(d, w))
    with settings.override(column_slab=1):
        check_forward(100, 20, 12, 2, 2, dtype=torch.float32, device="cpu", seed=seed, differentiated=differentiated)
    assert widest and set(widest) == ({2} if differentiated else {0}), widest


def test_widest_slab_bounds():
    """How wide the scratch may grow (``triton_combine.widest_slab``): the forward's
    scratch and act(h) within both weight gradients (the up weights as big as the down
    ones, twice as big for a gated activation) or, in training, the scratch within the
    down weights (their gradient runs beside w * act(h), as big as act(h)), the dX
    scratch within the up weights;
    ``column_slabs`` takes the fewest slabs of whole multiples of ``column_slab`` up to it,
    each as narrow as their count allows; none is wider than ``column_slab`` where nothing
    fits (``widest`` 0), and None makes one slab of every column."""
    from moeblaze_ops.kernels.triton_backend.combine import column_slabs, widest_slab

    # down: 100 rows of act(h) 6 wide, down weights of 1000 elements: (2000 - 600) / 100,
    # or (3000 - 600) / 100 where gated.
    assert widest_slab("down", 100, 6, 1000) == 14
    assert widest_slab("down", 100, 6, 1000, gated=True) == 24
    # act(h) alone is over the weight gradients' bound: in training the down weights' bound
    # (1000 / 100), without a backward none.
    assert widest_slab("down", 100, 30, 1000) == 10
    assert widest_slab("down", 100, 30, 1000, gated=True) == 10
    assert widest_slab("down", 100, 30, 1000, backward_follows=False) == 0
    assert widest_slab("down", 100, 30, 1000, gated=True, backward_follows=False) == 0
    assert widest_slab("down", 100, 6, 1000, gated=True, backward_follows=False) == 24
    assert widest_slab("dx", 100, 12, 1000) == 10
    assert widest_slab("dx", 100, 12, 1000, gated=True) == 10  # dX's bound has no gate factor
    assert widest_slab("dx", 0, 12, 1000) == 0
    with settings.override(column_slab=4):
        assert column_slabs(20, 14) == [(0, 12), (12, 20)]
        assert column_slabs(16, 12) == [(0, 8), (8, 16)]  # two slabs either way: 8 wide, not 12 and 4
        assert column_slabs(20, 3) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
        assert column_slabs(20, 0) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
        assert column_slabs(20, 40) == [(0, 20)]
    with settings.override(column_slab=None):
        assert column_slabs(20, 3) == [(0, 20)]


@hypothesis.settings(max_examples=300, deadline=None)
@given(d=st.integers(1, 20000), slab=st.integers(1, 600), widest=st.integers(0, 20000))
def test_column_slabs_cover(d, slab, widest):
    """``column_slabs`` cuts [0, d) into contiguous slabs, as many as slabs of the widest
    whole multiple of ``column_slab`` within ``widest`` make (of ``column_slab`` where none
    is wider), none wider than that multiple, all but the last whole multiples of
    ``column_slab``, the last no wider than the first."""
    from moeblaze_ops.kernels.triton_backend.grouped_gemm import cdiv
    from moeblaze_ops.kernels.triton_backend.combine import column_slabs

    with settings.override(column_slab=slab):
        slabs = column_slabs(d, widest)
    most = max(slab, widest // slab * slab)
    widths = [c1 - c0 for c0, c1 in slabs]
    assert slabs[0][0] == 0 and slabs[-1][1] == d and all(a[1] == b[0] for a, b in zip(slabs, slabs[1:]))
    assert len(slabs) == cdiv(d, most)
    assert max(widths) <= most and all(w % slab == 0 for w in widths[:-1]) and widths[-1] <= widths[0]


@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_widened_slabs(layout, seed, monkeypatch):
    """Slabs widened by the layer's weights (d = 40, slabs of 8 widened to 24 and 16 by
    ``widest_slab`` at these shapes): the forward and every gradient against the
    reference, and the slabs the kernels made are the widened ones."""
    from moeblaze_ops.kernels.triton_backend import combine as triton_combine

    made = []
    real = triton_combine.column_slabs

    def recording(d, widest=0):
        made.append(real(d, widest))
        return made[-1]

    monkeypatch.setattr(triton_combine, "column_slabs", recording)
    # 24 tokens, K = 2 (48 rows), d = 40, I = 12, E = 4 (SwiGLU): down weights 1920
    # elements, so (3 * 1920 - 48 * 12) / 48 = 108 columns fit; the dX scratch, 2 * 1920 / 48 = 80.
    with settings.override(column_slab=8):
        check_forward(24, 40, 12, 4, 2, dtype=torch.float32, device="cpu", seed=seed, layout=layout, bias=True)
        assert made and all(slabs == [(0, 40)] for slabs in made), made
    made.clear()
    # 45 tokens, K = 2 (90 rows), d = 40, I = 8, E = 3 (SwiGLU): down weights 960
    # elements, up weights 1920, so (2880 - 720) / 90 = 24 columns fit the forward's scratch
    # (two slabs, of 24 and 16) and 1920 / 90 = 21 the dX scratch (three, of 16, 16 and 8).
    with settings.override(column_slab=8):
        check_backward(45, 40, 8, 3, 2, dtype=torch.float32, device="cpu", seed=seed, layout=layout, bias=True,
                       routing="skewed", sentinel_frac=0.2)
    assert [(0, 24), (24, 40)] in made and [(0, 16), (16, 32), (32, 40)] in made, made


@pytest.mark.parametrize("chunk", [16, 128])
@pytest.mark.parametrize(
    "L,K,E,routing,sentinel_frac",
    [(33, 2, 8, "uniform", 0.0), (1, 1, 1, "uniform", 0.0), (200, 8, 64, "skewed", 0.1), (50, 3, 6, "first", 0.4),
     (40, 2, 6, "no_last", 0.0), (300, 4, 16, "uniform", 0.0)],
)
def test_dispatch_sorted_kernels_bitwise(L, K, E, routing, sentinel_frac, chunk, seed, monkeypatch):
    """The sorted-chunk dispatch kernels (chunks of 16 rows: many chunks, runs across chunk
    edges; of 128: padding past the last row), their scatter reading the ranks the
    histogram stored: the same three arrays as the portable dispatch, bit for bit."""
    _use_dispatch_family(monkeypatch, DISPATCH_FAMILIES[f"sorted{chunk}"])
    check_dispatch_bitwise(L, K, E, device="cpu", routing=routing, sentinel_frac=sentinel_frac, seed=seed)


@pytest.mark.parametrize(
    "L,K,E,routing,sentinel_frac",
    [(33, 2, 8, "uniform", 0.0), (1, 1, 1, "uniform", 0.0), (0, 4, 8, "uniform", 0.0), (256, 8, 256, "skewed", 0.1),
     (50, 3, 6, "first", 0.4), (12, 2, 4, "uniform", 1.0), (1024, 2, 3, "no_last", 0.0)],
)
def test_dispatch_one_program_bitwise(L, K, E, routing, sentinel_frac, seed, monkeypatch):
    """A routing dispatched by one program (one launch: its rows one sorted chunk, counted
    by a histogram), up to a chunk of 2048 rows and none at all: the same three arrays as
    the portable dispatch, bit for bit. The rule's bound raised to all one program can
    sort, the one-program kernel is what runs; the test fails if the multi-chunk kernels
    run instead."""
    from moeblaze_ops.kernels.triton_backend import grouped_gemm
    from moeblaze_ops.kernels.triton_backend import dispatch as triton_dispatch

    monkeypatch.setattr(config, "DISPATCH_ONE_PROGRAM_MAX_ROWS", config.MAX_ONE_PROGRAM_ROWS)
    assert config.dispatch_family(L * K, grouped_gemm.next_power_of_2(E)) == "one_program"
    ran = []
    kernel = triton_dispatch._one_program_dispatch
    with _recording_launches(triton_dispatch, ran):
        check_dispatch_bitwise(L, K, E, device="cpu", routing=routing, sentinel_frac=sentinel_frac, seed=seed)
    assert ran == [kernel]


def _recording_launches(module, ran):
    """A context in which ``module``'s launches are recorded (by kernel) into ``ran``."""
    from unittest import mock

    plain = module.launch

    def launch(kernel, *args, **kwargs):
        ran.append(kernel)
        return plain(kernel, *args, **kwargs)

    return mock.patch.object(module, "launch", launch)


def test_training_steps_keep_no_tensor_alive(seed):
    """Steps of forward + backward through the Triton kernels leave nothing behind: no tensor
    made during the second step is still alive after the third (a kernel launcher that kept
    its arguments, in a cache say, would keep a step's buffers every step). Tensors are
    followed by weak reference, so objects other tests leave to the collector do not count."""
    import gc
    import weakref

    layer = make_layer(40, 16, 8, 4, 2, seed=seed, requires_grad=True)

    def live_tensors():
        gc.collect()
        return [o for o in gc.get_objects() if torch.is_tensor(o)]

    def step():
        moe_experts(**layer).square().sum().backward()

    step()  # the first step creates the gradients, which later steps accumulate into
    before = {id(t) for t in live_tensors()}
    step()
    made = [weakref.ref(t) for t in live_tensors() if id(t) not in before]
    step()
    gc.collect()
    alive = [r() for r in made if r() is not None]
    assert not alive, [tuple(t.shape) for t in alive]


def test_row_tiles_in_bands(seed):
    """The row GEMMs' tiles (up, down, dX, dH) numbered in bands of ``config.ROW_BAND``
    m-tiles within each group (90 routed rows of 3 experts and the sentinel group make 6 to 9 m-tiles
    of 16, a short last band; d and 2I three n-tiles wide): forward and every gradient
    against the reference, every buffer poisoned first, so a tile the order skipped stays
    NaN."""
    assert config.ROW_BAND > 1
    check_forward(45, 40, 24, 3, 2, dtype=torch.float32, device="cpu", seed=seed, bias=True,
                  routing="skewed", sentinel_frac=0.2)
    check_backward(45, 40, 24, 3, 2, dtype=torch.float32, device="cpu", seed=seed, bias=True,
                   routing="skewed", sentinel_frac=0.2)


@triton.jit
def _number_row_tiles(offsets_ptr, out_ptr, E, LK, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS: tl.constexpr, BAND: tl.constexpr):
    """Writes (group, first row, first column) of every output tile ``gg.row_tile`` numbers."""
    for tile in range(0, gg.num_row_tiles(offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS)):
        grp, row0, _, _, n0, _, _ = gg.row_tile(tile, offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS, BAND)
        tl.store(out_ptr + 3 * tile, grp)
        tl.store(out_ptr + 3 * tile + 1, row0)
        tl.store(out_ptr + 3 * tile + 2, n0)


def _row_tile_numbering(offsets, LK, N, BLOCK_M, BLOCK_N, BAND):
    """[(group, first row, first column)] of every output tile, in the order
    ``grouped_gemm.row_tile`` numbers them (tiles never numbered stay -1)."""
    E = offsets.numel() - 1
    groups = list(zip(offsets.tolist(), offsets[1:].tolist() + [LK]))
    total = sum(-(-(hi - lo) // BLOCK_M) for lo, hi in groups) * -(-N // BLOCK_N)
    out = torch.full((max(total, 1), 3), -1, dtype=torch.int32)
    _number_row_tiles[(1,)](offsets, out, E, LK, N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                            GROUPS=gg.next_power_of_2(E + 1), BAND=BAND)
    return [tuple(t) for t in out[:total].tolist()]


@pytest.mark.parametrize("band", [1, 3, 4])
def test_row_tiles_stay_inside_their_expert(band, seed):
    """The row GEMMs' tile numbering (``grouped_gemm.row_tile``): each group's tiles
    together, the groups in order (experts, then the sentinel rows), each group's m-tiles
    in bands of ``band`` with the n-tiles, rows fastest inside a band and the group's last
    band short. A band that ran across two experts would read both weights in one wave, and
    an expert split over two bands its weight twice. Random expert sizes (empty experts,
    1 to 11 m-tiles), against the order written out here."""
    g = torch.Generator().manual_seed(seed)
    E, BLOCK_M, BLOCK_N, N = 7, 4, 8, 20
    counts = torch.randint(0, 44, (E,), generator=g)
    counts[torch.randint(0, E, (2,), generator=g)] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    LK = int(offsets[-1]) + 5  # five sentinel rows: group E
    expected = []
    for grp, (lo, hi) in enumerate(zip(offsets.tolist(), offsets[1:].tolist() + [LK])):
        m_tiles = -(-(hi - lo) // BLOCK_M)
        for first in range(0, m_tiles, band):
            for n in range(-(-N // BLOCK_N)):
                expected += [(grp, lo + m * BLOCK_M, n * BLOCK_N) for m in range(first, min(first + band, m_tiles))]
    assert _row_tile_numbering(offsets, LK, N, BLOCK_M, BLOCK_N, band) == expected


@pytest.mark.parametrize("kind", ["wgrad_down", "wgrad_up"])
def test_weight_gradient_gluon_launch_by_kind(kind, monkeypatch):
    """Where the Gluon weight gradient applies, ``launch_wgrad`` hands it the kind's tile
    override (None: the kernel's own) and the kind's rule for its MMA partitions
    (``config.wgrad_split_mma``: split for "wgrad_up" only). The Gluon module is a
    stand-in that records the launch (no GPU)."""
    from moeblaze_ops.kernels.triton_backend import grouped_gemm
    from moeblaze_ops.kernels.triton_backend import experts_backward as triton_experts_backward

    calls = []

    class FakeGluon:  # stands in for the Hopper module: records the choice, runs nothing
        @staticmethod
        def applies(rows, gathered):
            return True

        @staticmethod
        def launch_wgrad(rows, gathered, row_ids, offsets, grad_w_pq, tile, split_mma):
            calls.append((tile, split_mma))

    monkeypatch.setattr(grouped_gemm, "gluon_kernels", lambda kind, t, flop: FakeGluon)
    E, P, Q, rows_per_expert = 4, 16, 16, 32
    rows = torch.empty(E * rows_per_expert, P)
    ids = torch.zeros(E * rows_per_expert, dtype=torch.int32)
    offsets = torch.arange(E + 1, dtype=torch.int32) * rows_per_expert
    tuned = GemmTile(256, 64, 64, 4, 3)
    triton_experts_backward.launch_wgrad(rows, torch.empty(8, Q), ids, offsets, torch.empty(E, P, Q), kind=kind)
    with settings.override(tiles={kind: tuned}):
        triton_experts_backward.launch_wgrad(rows, torch.empty(8, Q), ids, offsets, torch.empty(E, P, Q), kind=kind)
    assert calls == [(None, kind == "wgrad_up"), (tuned, kind == "wgrad_up")]


@pytest.mark.parametrize("kind", ["up", "wgrad_up"])
def test_small_gemms_run_tl(kind, monkeypatch):
    """``grouped_gemm.gluon_kernels`` gives a GEMM of fewer operations than
    ``config.SMALL_GEMM_FLOP`` no Gluon kernel; from that count on, its kind's module; a
    kind without one (the ``tl`` kernel's wide dH tile) never has one. Only the device
    matters here, so a CUDA-looking stand-in takes the tensor's place."""
    pytest.importorskip("triton.experimental.gluon")
    from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm
    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad
    from moeblaze_ops.kernels.triton_backend import grouped_gemm

    class OnCuda:
        is_cuda = True

    monkeypatch.setattr(config, "SMALL_GEMM_FLOP", 1000)
    assert grouped_gemm.gluon_kernels(kind, OnCuda(), 999) is None
    assert grouped_gemm.gluon_kernels(kind, OnCuda(), 1000) is (gluon_row_gemm if kind == "up" else gluon_wgrad)
    assert grouped_gemm.gluon_kernels("dh_wide", OnCuda(), 10**15) is None


@pytest.mark.parametrize("flop", [999, 1000])
def test_small_gemms_read_weights_by_pointer(flop, monkeypatch):
    """``grouped_gemm.weight_operand`` gives a GEMM of fewer operations than
    ``config.SMALL_GEMM_FLOP`` the weight itself, not a TMA descriptor; from that count on,
    a descriptor of the weight where its kind reads weights by TMA
    (``config.WEIGHT_TMA_KINDS``), and the weight itself for the down projection."""
    from moeblaze_ops.kernels.triton_backend import grouped_gemm

    w = torch.randn(4, 64, 32, dtype=torch.bfloat16)
    tile = GemmTile(16, 16, 16, 4, 1)
    monkeypatch.setattr(config, "SMALL_GEMM_FLOP", 1000)
    src, tma, kmajor = grouped_gemm.weight_operand(w, w.stride(2), tile, "up", flop)
    assert tma == (flop >= 1000) and kmajor
    assert (src is w) != tma and (not tma or src.base is w)
    assert grouped_gemm.weight_operand(w, w.stride(2), tile, "down", 10**15)[1] is False


def test_weight_gradient_counts_its_operations(monkeypatch):
    """The weight gradient asks for its kernel with its operation count (2 x rows x P x Q),
    and where no Gluon kernel comes back, runs tl: right against float64."""
    from moeblaze_ops.kernels.triton_backend import grouped_gemm
    from moeblaze_ops.kernels.triton_backend import experts_backward as triton_experts_backward

    asked = []
    monkeypatch.setattr(grouped_gemm, "gluon_kernels", lambda kind, t, flop: asked.append(flop))
    g = torch.Generator().manual_seed(7)
    E, LK, P, Q = 3, 40, 16, 24
    rows, gathered = torch.randn(LK, P, generator=g), torch.randn(30, Q, generator=g)
    ids = torch.randint(0, 30, (LK,), dtype=torch.int32, generator=g)
    offsets = torch.tensor([0, 9, 9, LK], dtype=torch.int32)
    grad_w = torch.full((E, P, Q), float("nan"))
    triton_experts_backward.launch_wgrad(rows, gathered, ids, offsets, grad_w, kind="wgrad_up")
    assert asked == [2 * LK * P * Q]
    ref = torch.stack([rows[a:b].double().T @ gathered[ids[a:b].long()].double()
                       for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())])
    assert rel_err(grad_w, ref) < 1e-5


@pytest.mark.parametrize("n", [1, 2, 3, 63, 64, 65, 1000, 2**20 + 1])
@pytest.mark.parametrize("b", [1, 16, 128, 1024])
def test_host_index_math_matches_triton(n, b):
    """The launchers' host ``cdiv`` and ``next_power_of_2`` (plain Python: Triton's are
    constexpr functions, slow on the host) give Triton's values."""
    import triton

    from moeblaze_ops.kernels.triton_backend import grouped_gemm

    assert grouped_gemm.cdiv(n, b) == triton.cdiv(n, b)
    assert grouped_gemm.next_power_of_2(n) == triton.next_power_of_2(n)
