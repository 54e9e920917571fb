"""The Gluon row GEMM (``kernels.triton_backend.gluon.row_gemm``) on the GPU: every routed row against a float64
reference, over ragged, empty and sentinel-only experts, both weight layouts, gather and
bias or not, each kernel variant (``KERNELS``), column slabs (strided views), and the
gated activation in the epilogue (``GatedEpilogue``)."""

import pytest
import torch

from conftest import rel_err
from moeblaze_ops.layouts import expert_matrix, out_feature_slice


#: ``launch_row_gemm``'s kernels: the warp-specialised one (``config.row_gemm_warp_specialized``
#: picks it from many rows per expert) and the pipelined one.
KERNELS = {
    "ws": dict(warp_specialize=True),
    "pipelined": dict(warp_specialize=False),
}


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _expert_rows(counts, sentinels, device):
    """int32 offsets of experts owning ``counts`` rows, and the routed row count LK."""
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    return offsets.to(device), int(offsets[-1]) + sentinels


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a capability 9 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True], ids=["k_contiguous", "n_contiguous"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("gather,bias", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("counts,sentinels,K,N", [
    ([300, 0, 1, 129, 0, 1000, 64, 0], 77, 2880, 2816),  # ragged, empty experts, sentinels
    ([0, 0, 1500, 0], 0, 2880, 2816),  # every row on one expert, no sentinel
    ([0, 0, 0], 33, 64, 144),  # only sentinel rows
    ([37 * (i % 5) for i in range(40)], 200, 1408, 2880),  # 40 experts: GROUPS 64, K of the down projection
    ([1, 2, 3], 5, 16, 16),  # a single step, a single partial tile each
])
def test_gluon_row_gemm_matches_float64(counts, sentinels, K, N, gather, bias, kernel, transposed, dtype, seed):
    from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm

    g = torch.Generator(device="cuda").manual_seed(seed)
    E = len(counts)
    offsets, LK = _expert_rows(counts, sentinels, "cuda")
    T = 513  # token rows the gather reads from
    a = torch.randn(T if gather else LK, K, device="cuda", dtype=dtype, generator=g)
    a_row_ids = None
    if gather:
        a_row_ids = torch.randint(0, T, (LK,), device="cuda", dtype=torch.int32, generator=g)
    shape = (E, K, N) if transposed else (E, N, K)
    w = (torch.randn(shape, device="cuda", dtype=dtype, generator=g) / K ** 0.5)
    b = torch.randn(E, N, device="cuda", dtype=dtype, generator=g) if bias else None
    out = torch.full((LK, N), float("nan"), device="cuda", dtype=dtype)  # unwritten rows show
    assert gluon_row_gemm.applies(a, w, out, transposed)

    gluon_row_gemm.launch_row_gemm(a, a_row_ids, w, b, offsets, out, transposed, **KERNELS[kernel])
    torch.cuda.synchronize()

    rows = a[a_row_ids.long()] if gather else a
    bounds = offsets.tolist()
    assert not out.isnan().any()
    assert (out[bounds[E]:] == 0).all()  # sentinel rows
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        ref = rows[lo:hi].double() @ expert_matrix(w, e, transposed).double()
        if bias:
            ref += b[e].double()
        assert rel_err(out[lo:hi], ref) < 1e-2, f"expert {e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a capability 9 GPU")
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("transposed", [False, True], ids=["k_contiguous", "n_contiguous"])
def test_gluon_row_gemm_column_slab(transposed, kernel, seed):
    """A column slab of the weights into a column slab of the output (as the down
    projection's ``column_slab`` runs it): strided views, same result."""
    from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm

    g = torch.Generator(device="cuda").manual_seed(seed)
    counts, K, N, c0, c1 = [200, 0, 333, 90], 1408, 2880, 1024, 2048
    E = len(counts)
    offsets, LK = _expert_rows(counts, 40, "cuda")
    a = torch.randn(LK, K, device="cuda", dtype=torch.bfloat16, generator=g)
    shape = (E, K, N) if transposed else (E, N, K)
    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
    b = torch.randn(E, N, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.full((LK, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    w_slab, b_slab, out_slab = out_feature_slice(w, c0, c1, transposed), b[:, c0:c1], out[:, c0:c1]
    assert gluon_row_gemm.applies(a, w_slab, out_slab, transposed)

    gluon_row_gemm.launch_row_gemm(a, None, w_slab, b_slab, offsets, out_slab, transposed, **KERNELS[kernel])
    torch.cuda.synchronize()

    bounds = offsets.tolist()
    assert out[:, :c0].isnan().all() and out[:, c1:].isnan().all()  # nothing outside the slab
    assert (out_slab[bounds[E]:] == 0).all()
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            ref = a[lo:hi].double() @ expert_matrix(w_slab, e, transposed).double() + b_slab[e].double()
            assert rel_err(out_slab[lo:hi], ref) < 1e-2, f"expert {e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a capability 9 GPU")
@pytest.mark.parametrize("h_beside", [False, True], ids=["act_only", "h_beside"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("activation,dtype", [("swiglu", torch.bfloat16), ("geglu", torch.float16),
                                              ("clamped_swiglu", torch.bfloat16)])
@pytest.mark.parametrize("counts,sentinels,K,I", [
    ([300, 0, 1, 129, 0, 1000, 64, 0], 333, 2880, 384),  # ragged, empty experts, whole sentinel tiles
    ([0, 0, 0], 33, 64, 128),  # only sentinel rows
    ([1, 2, 3], 5, 16, 256),  # a single step, a single partial tile each
])
def test_gluon_row_gemm_gated_epilogue_matches_float64(counts, sentinels, K, I, activation, dtype, kernel, h_beside,
                                                       seed):
    """The up projection with its activation in the epilogue (``GatedEpilogue``): act(h)
    against float64, from gate and up columns paired in each tile; with ``h_beside``, h
    itself too, every column of it (``launch_row_gemm``'s ``h``)."""
    from moeblaze_ops.activations import activation_code, activation_forward, clamped_swiglu_defaults
    from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm

    g = torch.Generator(device="cuda").manual_seed(seed)
    E, T = len(counts), 513
    offsets, LK = _expert_rows(counts, sentinels, "cuda")
    x = torch.randn(T, K, device="cuda", dtype=dtype, generator=g)
    ids = torch.randint(0, T, (LK,), device="cuda", dtype=torch.int32, generator=g)
    w = torch.randn(E, 2 * I, K, device="cuda", dtype=dtype, generator=g) / K ** 0.5
    a = torch.full((LK, I), float("nan"), device="cuda", dtype=dtype)  # unwritten rows show
    h = torch.full((LK, 2 * I), float("nan"), device="cuda", dtype=dtype) if h_beside else None
    alpha, limit = clamped_swiglu_defaults()
    assert gluon_row_gemm.applies_gated_epilogue(x, w, None, a, False, int(activation_code(activation)), False, h=h)

    epilogue = gluon_row_gemm.GatedEpilogue(int(activation_code(activation)), alpha, limit)
    gluon_row_gemm.launch_row_gemm(x, ids, w, None, offsets, a, False, epilogue=epilogue, h=h, **KERNELS[kernel])
    torch.cuda.synchronize()

    bounds = offsets.tolist()
    assert not a.isnan().any() and (a[bounds[E]:] == 0).all()
    if h_beside:
        assert not h.isnan().any() and (h[bounds[E]:] == 0).all()
    rows = x[ids.long()].double()
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        h_ref = rows[lo:hi] @ w[e].double().T
        a_ref = activation_forward(h_ref, activation, alpha, limit, interleaved=False)
        assert rel_err(a[lo:hi], a_ref) < 1e-2, f"act(h), expert {e}"
        if h_beside:
            assert rel_err(h[lo:hi], h_ref) < 1e-2, f"h, expert {e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a capability 9 GPU")
def test_gluon_row_gemm_gated_epilogue_applies():
    """Where the epilogue cannot pair a tile's gate and up columns it says so, and the
    caller keeps the GEMM and the activation pass."""
    from moeblaze_ops.activations import activation_code
    from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm

    meta = dict(device="cuda", dtype=torch.bfloat16)
    x, a = torch.zeros(64, 256, **meta), torch.zeros(32, 384, **meta)
    w, swiglu = torch.zeros(4, 768, 256, **meta), int(activation_code("swiglu"))
    assert gluon_row_gemm.applies_gated_epilogue(x, w, None, a, False, swiglu, False)
    assert not gluon_row_gemm.applies_gated_epilogue(x, w, None, a, False, swiglu, True)  # interleaved
    assert not gluon_row_gemm.applies_gated_epilogue(x, w, torch.zeros(4, 768, **meta), a, False, swiglu, False)
    assert not gluon_row_gemm.applies_gated_epilogue(x, w.transpose(1, 2).contiguous(), None, a, True, swiglu, False)
    assert not gluon_row_gemm.applies_gated_epilogue(x, w, None, a, False, int(activation_code("silu")), False)
    assert gluon_row_gemm.applies_gated_epilogue(x, w, None, a, False, swiglu, False, h=torch.zeros(32, 768, **meta))
    assert not gluon_row_gemm.applies_gated_epilogue(x, w, None, a, False, swiglu, False,
                                                     h=torch.zeros(32, 776, **meta)[:, :768])  # h's stride
    odd = torch.zeros(32, 320, **meta)  # I = 320: a paired tile would reach the up columns
    assert not gluon_row_gemm.applies_gated_epilogue(x, torch.zeros(4, 640, 256, **meta), None, odd, False, swiglu,
                                                     False)
