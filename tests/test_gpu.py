"""GPU tests of the Triton kernels (run on the GPU machine: scripts/gpu_check.sh)."""

import pytest
import torch
import triton
import triton.language as tl

from conftest import make_layer, make_topk_ids, rel_err
from kernel_cases import check_backward, check_dispatch_bitwise, check_forward, check_frozen_grads, check_id_defects
from moeblaze_ops import ACTIVATIONS, moe_experts, settings
from moeblaze_ops.settings import GemmTile
from reference import reference_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def poison():
    # small_gemm_flop=0: the Gluon kernels run at these tests' sizes too, not only the tl ones.
    with settings.override(poison=True, small_gemm_flop=0):
        yield


def _reference(layer):
    return reference_moe(**{k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                            for k, v in layer.items()})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_forward(dtype, activation, layout, seed):
    check_forward(512, 256, 192, 8, 2, dtype=dtype, device="cuda", seed=seed, activation=activation,
                  layout=layout, bias=layout != "concatenated", tw_dtype=torch.float32)


@pytest.mark.parametrize(
    "L,E,K,routing,sentinel_frac",
    [(2048, 16, 2, "uniform", 0.0), (2048, 16, 2, "skewed", 0.0), (2048, 8, 1, "first", 0.0),
     (2048, 9, 2, "no_last", 0.0), (2048, 256, 8, "uniform", 0.0), (1, 8, 2, "uniform", 0.0),
     (1024, 8, 2, "uniform", 0.3)],
)
def test_forward_routings(L, E, K, routing, sentinel_frac, seed):
    check_forward(L, 256, 128, E, K, dtype=torch.bfloat16, device="cuda", seed=seed, routing=routing,
                  sentinel_frac=sentinel_frac, bias=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,I", [(2880, 1408), (200, 100), (72, 40)])
def test_forward_odd_sizes(d, I, dtype, seed):
    check_forward(777, d, I, 8, 2, dtype=dtype, device="cuda", seed=seed, tw_dtype=torch.float32,
                  layout="transposed_interleaved" if d == 2880 else "concatenated")


@pytest.mark.parametrize("L,K,E,routing,sentinel_frac",
                         [(65536, 8, 128, "uniform", 0.0), (50000, 4, 16, "skewed", 0.0), (7, 2, 256, "uniform", 0.0),
                          (30000, 8, 64, "uniform", 0.2), (4096, 1, 1, "uniform", 0.0)])
def test_dispatch_bitwise(L, K, E, routing, sentinel_frac, seed):
    check_dispatch_bitwise(L, K, E, device="cuda", routing=routing, sentinel_frac=sentinel_frac, seed=seed)


@pytest.mark.parametrize("family", ["one_hot", "sorted"])
@pytest.mark.parametrize("L,K,E,routing,sentinel_frac", [(65536, 8, 128, "uniform", 0.0), (4096, 8, 256, "skewed", 0.1),
                                                         (50000, 4, 16, "first", 0.3), (1048576, 8, 256, "uniform", 0.0)])
def test_dispatch_kernel_families_bitwise(L, K, E, routing, sentinel_frac, family, seed):
    """Both dispatch kernel families at every E, whatever the default threshold picks: the
    one-hot kernels and the sorted-chunk kernels equal the portable dispatch bit for bit."""
    with settings.override(dispatch_sorted_min_bins=None if family == "one_hot" else 1,
                           dispatch_one_program_max_rows=None):
        check_dispatch_bitwise(L, K, E, device="cuda", routing=routing, sentinel_frac=sentinel_frac, seed=seed)


@pytest.mark.parametrize("L,K,E,routing,sentinel_frac", [(512, 8, 128, "uniform", 0.0), (1024, 8, 256, "skewed", 0.1),
                                                         (2048, 2, 32, "first", 0.3), (7, 2, 256, "uniform", 0.0),
                                                         (8192, 1, 64, "uniform", 0.0), (3000, 2, 8, "no_last", 0.0)])
def test_dispatch_one_program_bitwise(L, K, E, routing, sentinel_frac, seed):
    """Routings of up to the largest bound dispatched by one program (one sorted chunk of up
    to 8192 rows): the portable dispatch's arrays, bit for bit."""
    with settings.override(dispatch_one_program_max_rows=settings.MAX_ONE_PROGRAM_ROWS):
        check_dispatch_bitwise(L, K, E, device="cuda", routing=routing, sentinel_frac=sentinel_frac, seed=seed)


@pytest.mark.parametrize("K", [1, 3, 8])
def test_invalid_id_flags_one_program(K, seed):
    """The id checks of the one-program dispatch: flags raised exactly for negative and
    repeated ids, none for repeated sentinels."""
    L, E = 1024, 64
    ids = make_topk_ids(L, K, E, generator=torch.Generator().manual_seed(seed))
    with settings.override(dispatch_one_program_max_rows=settings.MAX_ONE_PROGRAM_ROWS):
        check_id_defects(ids, E, negative_at=(L - 1, K - 1), repeat_in=900)


def _cuda_layer(seed, L=1024):
    layer = make_layer(L, 256, 128, 8, 2, dtype=torch.bfloat16, seed=seed, tw_dtype=torch.float32)
    return {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in layer.items()}


def test_forward_without_host_sync(seed):
    layer = _cuda_layer(seed)
    moe_experts(**layer)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe_experts(**layer)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(out, _reference(layer)) <= 1e-2, f"seed={seed}"


def test_forward_in_cuda_graph(seed):
    static = _cuda_layer(seed)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_experts(**static)  # warm up (compiles the kernels) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(**static)
    for step in range(3):  # new inputs, new routing, same shapes
        fresh = _cuda_layer(seed + 1 + step)
        for k in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down"):
            static[k].copy_(fresh[k])
        graph.replay()
        assert rel_err(out, _reference(fresh)) <= 1e-2, f"replay {step} seed={seed}"


# ----------------------------------------------------------------------------- backward
# The Triton backward is the default on CUDA; the fixture pins it whatever the environment says.


@pytest.fixture
def triton_bwd():
    with settings.override(triton_backward=True):
        yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu", "gelu"])
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_backward(dtype, activation, layout, seed, triton_bwd):
    check_backward(512, 256, 192, 8, 2, dtype=dtype, device="cuda", seed=seed, activation=activation,
                   layout=layout, bias=layout != "concatenated", tw_dtype=torch.float32)


@pytest.mark.parametrize(
    "L,E,K,routing,sentinel_frac",
    [(2048, 16, 2, "skewed", 0.0), (2048, 8, 1, "first", 0.0), (2048, 9, 2, "no_last", 0.0),
     (2048, 256, 8, "uniform", 0.0), (1, 8, 2, "uniform", 0.0), (1024, 8, 2, "uniform", 0.3)],
)
def test_backward_routings(L, E, K, routing, sentinel_frac, seed, triton_bwd):
    check_backward(L, 256, 128, E, K, dtype=torch.bfloat16, device="cuda", seed=seed, routing=routing,
                   sentinel_frac=sentinel_frac, bias=True)


@pytest.mark.parametrize("d,I", [(2880, 1408), (200, 100)])
def test_backward_odd_sizes(d, I, seed, triton_bwd):
    check_backward(777, d, I, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, tw_dtype=torch.float32,
                   layout="transposed_interleaved" if d == 2880 else "concatenated")


@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_recompute_backward(layout, seed, triton_bwd):
    check_backward(777, 256, 192, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout=layout,
                   bias=True, tw_dtype=torch.float32, recompute=True)


@pytest.mark.parametrize("trainable", [("x", "topk_weights"), ("w_gate_up", "w_down", "b_gate_up", "b_down")])
def test_backward_skips_frozen(trainable, seed, triton_bwd):
    check_frozen_grads(777, 256, 192, 8, 2, trainable=trainable, dtype=torch.bfloat16, device="cuda", seed=seed)


def test_forward_backward_without_host_sync(seed, triton_bwd):
    layer = _cuda_layer(seed)
    params = [layer[k].requires_grad_(True) for k in ("x", "topk_weights", "w_gate_up", "w_down")]
    moe_experts(**layer).float().square().mean().backward()  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = torch.autograd.grad(moe_experts(**layer).float().square().mean(), params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_inputs = {k: (v.detach().double().requires_grad_(v.requires_grad) if torch.is_tensor(v) and
                      v.is_floating_point() else v) for k, v in layer.items()}
    ref_grads = torch.autograd.grad(reference_moe(**ref_inputs).square().mean(),
                                    [ref_inputs[k] for k in ("x", "topk_weights", "w_gate_up", "w_down")])
    for name, g, r in zip(("x", "topk_weights", "w_gate_up", "w_down"), grads, ref_grads):
        assert rel_err(g, r) <= 2e-2, f"grad {name} seed={seed}"


def test_training_step_in_cuda_graph(seed, triton_bwd):
    """Forward, backward and an SGD step of the experts layer, captured once and replayed
    on new inputs: the weights move as an eager step from the same state moves them."""
    static = _cuda_layer(seed)
    params = [static[k].requires_grad_(True) for k in ("w_gate_up", "w_down")]
    lr = 0.1

    def step(layer, weights):
        out = moe_experts(**{**layer, "w_gate_up": weights[0], "w_down": weights[1]})
        grads = torch.autograd.grad(out.float().square().mean(), weights)
        with torch.no_grad():
            for p, g in zip(weights, grads):
                p.sub_(lr * g)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static, params)  # warm up (compiles the kernels) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static, params)
    for i in range(2):
        fresh = _cuda_layer(seed + 10 + i)
        for k in ("x", "topk_ids", "topk_weights"):
            static[k].copy_(fresh[k])
        before = [p.detach().clone().requires_grad_(True) for p in params]
        expected = [p.detach().clone().requires_grad_(True) for p in params]
        step(static, expected)  # eager step from the same state
        with torch.no_grad():
            for p, b in zip(params, before):
                p.copy_(b)
        graph.replay()
        for p, e in zip(params, expected):
            assert rel_err(p, e) <= 1e-3, f"replay {i} seed={seed}"


@pytest.mark.parametrize("family", ["onehot", "sorted"])
@pytest.mark.parametrize("K", [1, 2, 3, 8])
def test_invalid_id_flags(K, family, seed):
    """The device-side id check, folded into the dispatch kernels of either family: flags
    raised exactly for negative and repeated ids, also in a token whose K rows straddle the
    first chunk edge (K = 3), its bad id past the edge."""
    from moeblaze_ops.kernels.triton_dispatch import _chunk_size, invalid_id_flags

    g = torch.Generator().manual_seed(seed)
    L, E = 4096, 64
    ids = make_topk_ids(L, K, E, generator=g)
    with settings.override(dispatch_sorted_min_bins=1 if family == "sorted" else None,
                           dispatch_one_program_max_rows=None):
        edge = settings.current().dispatch_sort_chunk if family == "sorted" else _chunk_size(L * K)
        check_id_defects(ids, E, negative_at=(17, 0), repeat_in=4000)
        if edge % K:
            token = edge // K
            bad = ids.clone()
            bad[token, K - 1] = -1
            assert invalid_id_flags(bad.cuda(), E).tolist() == [1, 0]
            bad = ids.clone()
            bad[token, K - 1] = bad[token, 0]
            assert invalid_id_flags(bad.cuda(), E).tolist() == [0, 1]
        assert invalid_id_flags(ids.to(torch.int32).cuda(), E).tolist() == [0, 0]


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_weight_tma(layout, on, seed, triton_bwd):
    """Weight tiles through TMA descriptors in every GEMM that has the option (up, dH, dX),
    or in none (``settings.weight_tma``): forward and every gradient still match the
    reference."""
    with settings.override(weight_tma={"up", "dh", "dx"} if on else set()):
        check_forward(777, 2880, 1408, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout=layout,
                      bias=True, tw_dtype=torch.float32)
        check_backward(777, 256, 192, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout=layout,
                       bias=True, tw_dtype=torch.float32)


@pytest.mark.parametrize("choice", [{"fast_activation": True},
                                    {"fast_activation": False}, {"gluon": ("wgrad_down", "wgrad_up")},
                                    {"gluon": settings.GLUON_KINDS},
                                    {"gluon": settings.GLUON_KINDS, "gluon_warp_specialize": ()},
                                    {"gluon": settings.GLUON_KINDS, "gluon_warp_specialize": settings.GLUON_KINDS},
                                    {"gluon": settings.GLUON_KINDS, "row_tma_store": True},
                                    {"gluon": settings.GLUON_KINDS, "gluon_warp_specialize": (), "row_tma_store": True},
                                    {"gluon": ()}, {"row_band": 3, "wgrad_band": 3},
                                    {"wgrad_rows_tma": ("wgrad_down", "wgrad_up")},
                                    {"wgrad_rows_tma": ()}, {"wgrad_tma_store": False},
                                    {"row_band": 1, "wgrad_band": 1},
                                    {"gluon": settings.GLUON_KINDS, "row_band": 3},
                                    {"gluon": settings.GLUON_KINDS, "row_band": 1},
                                    {"dh_epilogue_columns": None}, {"dh_wide_min_columns": 0},
                                    {"dh_wide_min_columns": 0, "dh_epilogue_columns": 128}],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("activation,layout", [("swiglu", "interleaved"), ("clamped_swiglu", "transposed"),
                                               ("silu", "concatenated")])
def test_kernel_choices(choice, activation, layout, seed, triton_bwd):
    """Both sides of the kernel choices without a test of their own: the down GEMM on an
    activation pass or with the activation in its prologue (h through TMA descriptors or
    plain loads there), the approximate-tanh sigmoid or the exact one, the weight
    gradients on the Gluon kernel or the tl one, the GEMM tiles in bands of 3 row tiles
    (a short last band), of 1 (along each row) or of the default 4, the Gluon row GEMMs'
    tiles stored by TMA or from registers, their MMA warpgroups in partitions of their own,
    the dH epilogue whole
    or in slices, dH on its wide tile (4 slices, or 2 of 128 columns): forward and every
    gradient against the reference."""
    with settings.override(**choice):
        check_forward(777, 512, 384, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, activation=activation,
                      layout=layout, bias=True, tw_dtype=torch.float32)
        check_backward(777, 256, 192, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, activation=activation,
                       layout=layout, bias=True, tw_dtype=torch.float32)


@pytest.mark.parametrize("route", ["warp_specialized", "pipelined", "activation_in_down"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "clamped_swiglu"])
def test_forward_activation_routes(activation, route, seed):
    """The forward without gradients, ``settings.up_epilogue_activation`` on (act(h) from
    the Gluon up GEMM's epilogue on Hopper, each kernel; small_gemm_flop 0 puts this size
    on Gluon; elsewhere the GEMM then the pass) or off (h, activated by the down
    projection): against the reference."""
    rows = {k: v for k, v in settings.current().gluon_warp_specialize.items() if k != "up"}
    with settings.override(up_epilogue_activation=route != "activation_in_down", small_gemm_flop=0,
                           gluon_warp_specialize={**rows, "up": 0} if route == "warp_specialized" else rows):
        check_forward(777, 512, 384, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, activation=activation,
                      tw_dtype=torch.float32)


@pytest.mark.parametrize("route", ["warp_specialized", "pipelined"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "clamped_swiglu"])
def test_activation_beside_h(activation, route, seed, triton_bwd, monkeypatch):
    """``settings.activation_beside_h`` on (I = 384, 194 rows an expert): the Gluon up
    GEMM's epilogue writes h and act(h) (each kernel; small_gemm_flop 0 puts this size on Gluon) and the down
    projection reads act(h), running no activation pass; the forward of a differentiated
    layer and every gradient against the reference."""
    from moeblaze_ops.kernels import triton_experts

    passes = []
    pass_kernel = triton_experts.launch_activation
    monkeypatch.setattr(triton_experts, "launch_activation", lambda *args: (passes.append(args), pass_kernel(*args)))
    rows = {k: v for k, v in settings.current().gluon_warp_specialize.items() if k != "up"}
    with settings.override(activation_beside_h_max_columns=384, activation_beside_h_min_rows=0, small_gemm_flop=0,
                           gluon_warp_specialize={**rows, "up": 0} if route == "warp_specialized" else rows):
        check_forward(777, 512, 384, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, activation=activation,
                      tw_dtype=torch.float32, differentiated=True)
        assert not passes
        check_backward(777, 256, 384, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, activation=activation,
                       tw_dtype=torch.float32)
        assert not passes


def test_activation_beside_h_peak(seed):
    """A training step with act(h) beside h peaks no higher than without (within 2%): act(h)
    lives from the up projection to the down one, as the activation pass's output does, and
    backward makes nothing of its size (autograd would zero-fill a gradient for it)."""
    layer = make_layer(4096, 512, 1024, 16, 4, dtype=torch.bfloat16, seed=seed, requires_grad=True,
                       tw_dtype=torch.float32)
    layer = {k: v.cuda().detach().requires_grad_(v.requires_grad) if torch.is_tensor(v) else v
             for k, v in layer.items()}
    grad = torch.randn_like(layer["x"])

    def peak():
        moe_experts(**layer).backward(grad)  # the kernels compiled, the blocks cached
        for t in layer.values():
            if torch.is_tensor(t):
                t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        moe_experts(**layer).backward(grad)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    with settings.override(activation_beside_h_min_rows=0):
        beside = peak()
    with settings.override(activation_beside_h_max_columns=None):
        apart = peak()
    assert beside <= apart * 1.02, (beside, apart)


@pytest.mark.parametrize("slab", [1024, None], ids=["slabs_1024", "no_slabs"])
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_column_slabs(layout, slab, seed, triton_bwd):
    """The [L*K, d] scratch made in column slabs (1024 of d = 2880: two whole slabs and a
    partial one) and in one piece (None): forward and every gradient against the reference."""
    with settings.override(column_slab=slab, column_slab_widen=False):
        check_forward(777, 2880, 1408, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout=layout,
                      bias=True, tw_dtype=torch.float32)
        check_backward(777, 2880, 192, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout=layout,
                       bias=True, tw_dtype=torch.float32)


@pytest.mark.parametrize("columns", [None, 64, 32], ids=["whole", "halves", "quarters"])
@pytest.mark.parametrize("fast", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu", "silu"])
def test_dh_epilogue(activation, fast, columns, seed, triton_bwd):
    """The dH epilogue with the approximate-tanh sigmoid (``settings.dh_fast_activation``,
    the default) and with the exact one, over the whole 128-column tile, in two column
    halves (the default) or quarters (``settings.dh_epilogue_columns``): every gradient
    within the bf16 tolerance of the reference."""
    with settings.override(dh_fast_activation=fast, dh_epilogue_columns=columns):
        check_backward(512, 256, 192, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed,
                       activation=activation,
                       layout="transposed_interleaved" if activation == "clamped_swiglu" else "concatenated",
                       bias=True, tw_dtype=torch.float32)


@pytest.mark.parametrize("defect", ["none", "decreasing_offsets", "token_out_of_range"])
def test_index_arrays_checked_on_the_device(defect, seed):
    """expert_down fed index arrays that are not a dispatch result fails the device-side
    check (a device-side assert, so in a fresh process: it poisons the CUDA context);
    right arrays pass. No host sync either way (sync debug mode is on)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch, moeblaze_ops
        from moeblaze_ops.testing import make_layer
        layer = {{k: (v.cuda() if torch.is_tensor(v) else v)
                  for k, v in make_layer(64, 64, 32, 4, 2, dtype=torch.bfloat16, seed={seed}).items()}}
        eti, offsets, tim = moeblaze_ops.dispatch(layer["topk_ids"], 4)
        h = torch.ops.moeblaze.expert_up(layer["x"], layer["w_gate_up"], eti, offsets, tim)
        if "{defect}" == "decreasing_offsets":
            offsets[2] = offsets[3] + 1
        elif "{defect}" == "token_out_of_range":
            eti[5] = 64
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        out = torch.ops.moeblaze.expert_down(h, layer["w_down"], eti, offsets, tim, layer["topk_weights"])
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        print("finite", bool(torch.isfinite(out).all()))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    if defect == "none":
        assert run.returncode == 0 and "finite True" in run.stdout, run.stderr[-2000:]
    else:
        assert run.returncode != 0 and "device-side assert" in run.stderr, run.stderr[-2000:]


# ----------------------------------------------------------------------------- weight-gradient kernels


WGRAD_VARIANTS = ["gluon_ws", "gluon", "gluon_band3", "gluon_rows_tma", "gluon_rows_tma_band3",
                  "gluon_rows_tma_2_per_sm", "gluon_rows_tma_store", "gluon_rows_tma_store_band3", "gluon_store",
                  "gluon_rows_tma_ws", "gluon_rows_tma_ws_store", "gluon_rows_tma_store_whole",
                  "gluon_rows_tma_ws_store_whole", "gluon_rows_tma_ws_split", "gluon_rows_tma_ws_store_split", "tl"]


def _variant_tile(variant):
    """The tile of weight-gradient kernel ``variant`` (None: the kernel's default). "whole":
    three stages, so each output tile is stored whole (``gluon_common.store_pieces``)."""
    if variant.endswith("2_per_sm"):
        return GemmTile(128, 128, 64, 8, 3, 2)
    if variant.endswith("whole"):
        return GemmTile(256, 128, 64, 8, 3)
    return None


def _wgrad_settings(variant):
    """The settings that run weight-gradient kernel ``variant`` (of ``WGRAD_VARIANTS``) for "wgrad_up"."""
    tile = _variant_tile(variant)
    tiles = {"wgrad_up": tile} if tile is not None else {}
    return settings.override(tiles=tiles, gluon={"wgrad_up"} if variant != "tl" else set(),
                             gluon_warp_specialize={"wgrad_up"} if "ws" in variant.split("_") else set(),
                             wgrad_rows_tma={"wgrad_up"} if "rows_tma" in variant else set(),
                             wgrad_tma_store="store" in variant,
                             wgrad_split_mma={"wgrad_up"} if variant.endswith("split") else set(),
                             wgrad_band=3 if variant.endswith("band3") else 1)


@pytest.mark.parametrize("gluon", WGRAD_VARIANTS)
@pytest.mark.parametrize("P,Q,transposed_out", [(192, 2880, False), (1408, 256, True), (64, 16, False)])
def test_weight_gradient_kernels(gluon, P, Q, transposed_out, seed):
    """Every weight-gradient kernel, the four Gluon ones (where they apply: these shapes;
    warp-specialised, with the row-ordered operand by TMA, both, or neither; tiles in bands of 3
    tile rows, a short last band at P=1408; output tiles by TMA copies in both orientations
    of the gradient, where a program has more than one tile, in halves or whole) and the
    portable tl one: out[e] = A_e^T B[ids_e] against a float64 reference, with
    ragged and empty experts, tiles that run past P and Q, a transposed output view, a
    poisoned output (a tile the order skipped stays NaN), and two runs bitwise equal."""
    from moeblaze_ops.kernels import gluon_common, gluon_wgrad
    from moeblaze_ops.kernels.triton_experts_backward import launch_wgrad

    g = torch.Generator(device="cuda").manual_seed(seed)
    E, LK, T = 16, 3001, 1200
    cuts = torch.sort(torch.randint(0, LK, (E - 1,), device="cuda", generator=g)).values
    cuts[4] = cuts[5]  # expert 5 is empty, whatever the draw
    offsets = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), LK)]).to(torch.int32)
    rows = torch.randn(LK, P, device="cuda", dtype=torch.bfloat16, generator=g)
    gathered = torch.randn(T, Q, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(0, T, (LK,), device="cuda", dtype=torch.int32, generator=g)
    assert gluon_wgrad.applies(rows, gathered)

    def run():
        out = torch.full((E, Q, P) if transposed_out else (E, P, Q), float("nan"), device="cuda",
                         dtype=torch.bfloat16)
        view = out.transpose(1, 2) if transposed_out else out
        with _wgrad_settings(gluon):
            launch_wgrad(rows, gathered, ids, offsets, view, kind="wgrad_up")
        if "store" in gluon:  # the variant writes by TMA here (whole tiles where named), not through its fallback
            rows_tma = "rows_tma" in gluon
            tile = _variant_tile(gluon) or (gluon_wgrad.ROWS_TMA_TILE if rows_tma else gluon_wgrad.TILE)
            pieces = gluon_common.store_pieces(tile, view.element_size(), view.device)
            assert pieces == (1 if gluon.endswith("whole") else 2)
            assert gluon_wgrad._output_descriptor(view, tile, rows_tma, pieces)[0] is not None
        return view

    out = run()
    bounds = offsets.tolist()
    ref = torch.stack([rows[lo:hi].double().T @ gathered[ids[lo:hi].long()].double()
                       for lo, hi in zip(bounds[:-1], bounds[1:])])
    assert rel_err(out, ref) <= 1e-2, f"seed={seed}"
    assert out[5].eq(0).all(), "an empty expert's gradient is zero"
    assert torch.equal(out, run()), "two runs differ"


@pytest.mark.parametrize("gluon", WGRAD_VARIANTS)
def test_weight_gradients_keep_experts_apart(gluon, seed):
    """An infinite row of one expert's operand reaches that expert's gradient alone: the
    rows past an expert's end that its last step covers are masked, so the next expert's
    values never meet its sum, not even as inf * 0 (which a kernel that read whole steps
    and relied on the zero-filled gathered rows would let through)."""
    from moeblaze_ops.kernels.triton_experts_backward import launch_wgrad

    g = torch.Generator(device="cuda").manual_seed(seed)
    E, LK, T, P, Q = 8, 1000, 300, 128, 256
    # Expert sizes that are not multiples of the 64-row steps; expert 3 starts mid-step.
    offsets = torch.tensor([0, 100, 230, 301, 470, 600, 777, 900, LK], device="cuda", dtype=torch.int32)
    rows = torch.randn(LK, P, device="cuda", dtype=torch.bfloat16, generator=g)
    rows[301] = float("inf")  # expert 3's first row, inside expert 2's last step
    gathered = torch.randn(T, Q, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(0, T, (LK,), device="cuda", dtype=torch.int32, generator=g)
    out = torch.full((E, P, Q), float("nan"), device="cuda", dtype=torch.bfloat16)
    with _wgrad_settings(gluon):
        launch_wgrad(rows, gathered, ids, offsets, out, kind="wgrad_up")
    finite = out.flatten(1).isfinite().all(dim=1).tolist()
    assert finite == [e != 3 for e in range(E)], f"seed={seed}: finite gradients by expert {finite}"


# --------------------------------------------------------------------------- launch plans


@triton.jit
def _scaled_rows_kernel(src_ptr, dst_ptr, n, stride, scale, BLOCK: tl.constexpr):
    """dst[r, :n] = src[r, :n] * scale: a kernel whose specialisation the arguments below vary."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(src_ptr + row * stride + cols, mask=mask)
    tl.store(dst_ptr + row * stride + cols, x * scale, mask=mask)


@pytest.mark.parametrize("offset", [0, 1, 8])
@pytest.mark.parametrize("n", [1, 16, 17, 40])
def test_launch_plans_run_the_kernel_the_jit_picks(offset, n, seed):
    """Pointers aligned or not, ints equal to 1, divisible by 16 or neither: every launch
    after the first runs through a plan, and the plan holds the compiled kernel Triton's
    JIT picks for those arguments; the results are right each time."""
    from moeblaze_ops.kernels import launch as plans

    g = torch.Generator(device="cuda").manual_seed(seed)
    rows, stride = 3, 48
    src = torch.randn(offset + rows * stride, device="cuda", generator=g)[offset:]
    dst = torch.full_like(src, float("nan"))
    args = (src, dst, n, stride, 0.5)
    for _ in range(3):  # the JIT's path, then the plan's
        dst.fill_(float("nan"))
        plans.launch(_scaled_rows_kernel, (rows,), *args, BLOCK=64)
        got, want = dst.view(rows, stride)[:, :n], src.view(rows, stride)[:, :n] * 0.5
        assert torch.equal(got, want)
        assert dst.view(rows, stride)[:, n:].isnan().all(), "a column past n was written"
    sig = plans.kernel_signature(_scaled_rows_kernel)
    key, _ = plans.plan_key(sig, torch.cuda.current_device(), args, dict(BLOCK=64))
    assert sig.plans[key] is _scaled_rows_kernel[(rows,)](*args, BLOCK=64)


@pytest.mark.parametrize("aligned", [True, False])
def test_launch_plans_equal_the_jit_bitwise(aligned, seed):
    """A layer's forward and backward through plans equals the JIT's launches bit for bit,
    with x whose rows start off the 16-byte grid (a plan for aligned x must not serve it)
    run between aligned ones."""
    def step(layer):
        x, w_gate_up, w_down = (layer[k].detach().requires_grad_(True) for k in ("x", "w_gate_up", "w_down"))
        out = moe_experts(x, layer["topk_ids"], layer["topk_weights"], w_gate_up, w_down)
        out.backward(layer["grad"])
        return out, x.grad, w_gate_up.grad, w_down.grad

    layers = []
    for i, misaligned in enumerate((False, not aligned, False)):
        layer = {k: (v.cuda() if torch.is_tensor(v) else v)
                 for k, v in make_layer(300, 136, 72, 8, 2, dtype=torch.bfloat16, seed=seed + i).items()}
        if misaligned:  # one element in: data_ptr() % 16 == 2
            x = torch.empty(layer["x"].numel() + 1, dtype=torch.bfloat16, device="cuda")[1:].view_as(layer["x"])
            layer["x"] = x.copy_(layer["x"])
        layer["grad"] = torch.randn(300, 136, device="cuda", dtype=torch.bfloat16)
        layers.append(layer)
    with settings.override(launch_plans=False):
        want = [step(layer) for layer in layers]
    for _ in range(2):
        for layer, expected in zip(layers, want):
            for got, ref in zip(step(layer), expected):
                assert torch.equal(got, ref), f"seed={seed}"
