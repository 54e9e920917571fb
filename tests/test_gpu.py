"""GPU tests of the Triton kernels (run on the GPU machine: scripts/gpu_check.sh)."""

import pytest
import torch
import triton
import triton.language as tl

from conftest import make_layer, make_topk_ids, rel_err
from kernel_cases import check_backward, check_dispatch_bitwise, check_forward, check_frozen_grads, check_id_defects
from moeblaze_ops import ACTIVATIONS, moe_experts, settings
from moeblaze_ops.kernels import config
from moeblaze_ops.kernels.config import GemmTile
from reference import reference_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


#: ``config.SMALL_GEMM_FLOP`` as the rule has it: these tests' GEMMs are all small then.
SMALL_GEMM_FLOP = config.SMALL_GEMM_FLOP


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    # SMALL_GEMM_FLOP 0: the Gluon kernels (and TMA weights) run at these tests' sizes too,
    # not only the tl ones; a test puts it back to run the tl kernels.
    monkeypatch.setattr(config, "SMALL_GEMM_FLOP", 0)
    with settings.override(poison=True):
        yield


def _patch_config(monkeypatch, constants):
    """Puts ``constants`` (names of ``kernels.config`` and values) in force for the test."""
    for name, value in constants.items():
        monkeypatch.setattr(config, name, value)


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


#: The constants of ``config.dispatch_family`` that send every routing to one kernel family.
DISPATCH_FAMILIES = {"one_hot": dict(DISPATCH_SORTED_MIN_BINS=2**31, DISPATCH_ONE_PROGRAM_MAX_ROWS=-1),
                     "sorted": dict(DISPATCH_SORTED_MIN_BINS=1, DISPATCH_ONE_PROGRAM_MAX_ROWS=-1),
                     "one_program": dict(DISPATCH_ONE_PROGRAM_MAX_ROWS=config.MAX_ONE_PROGRAM_ROWS)}


@pytest.mark.parametrize("family", ["one_hot", "sorted"])
@pytest.mark.parametrize("L,K,E,routing,sentinel_frac", [(65536, 8, 128, "uniform", 0.0), (4096, 8, 256, "skewed", 0.1),
                                                         (50000, 4, 16, "first", 0.3), (1048576, 8, 256, "uniform", 0.0)])
def test_dispatch_kernel_families_bitwise(L, K, E, routing, sentinel_frac, family, seed, monkeypatch):
    """Both dispatch kernel families at every E, whatever the rule's threshold picks: the
    one-hot kernels and the sorted-chunk kernels equal the portable dispatch bit for bit."""
    _patch_config(monkeypatch, DISPATCH_FAMILIES[family])
    check_dispatch_bitwise(L, K, E, device="cuda", routing=routing, sentinel_frac=sentinel_frac, seed=seed)


@pytest.mark.parametrize("L,K,E,routing,sentinel_frac", [(512, 8, 128, "uniform", 0.0), (1024, 8, 256, "skewed", 0.1),
                                                         (2048, 2, 32, "first", 0.3), (7, 2, 256, "uniform", 0.0),
                                                         (8192, 1, 64, "uniform", 0.0), (3000, 2, 8, "no_last", 0.0)])
def test_dispatch_one_program_bitwise(L, K, E, routing, sentinel_frac, seed, monkeypatch):
    """Routings of up to the largest bound dispatched by one program (one sorted chunk of up
    to 8192 rows): the portable dispatch's arrays, bit for bit."""
    _patch_config(monkeypatch, DISPATCH_FAMILIES["one_program"])
    check_dispatch_bitwise(L, K, E, device="cuda", routing=routing, sentinel_frac=sentinel_frac, seed=seed)


@pytest.mark.parametrize("K", [1, 3, 8])
def test_invalid_id_flags_one_program(K, seed, monkeypatch):
    """The id checks of the one-program dispatch: flags raised exactly for negative and
    repeated ids, none for repeated sentinels."""
    L, E = 1024, 64
    ids = make_topk_ids(L, K, E, generator=torch.Generator().manual_seed(seed))
    _patch_config(monkeypatch, DISPATCH_FAMILIES["one_program"])
    check_id_defects(ids, E, negative_at=(L - 1, K - 1), repeat_in=900)


def _cuda_layer(seed, L=1024):
    layer = make_layer(L, 256, 128, 8, 2, dtype=torch.bfloat16, seed=seed, tw_dtype=torch.float32)
    return {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in layer.items()}


@pytest.mark.parametrize("L", [1, 7, 1024])
def test_forward_without_host_sync(L, seed):
    """No host sync in the forward, at decode sizes (the decode tiles) and above."""
    layer = _cuda_layer(seed, L)
    moe_experts(**layer)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe_experts(**layer)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(out, _reference(layer)) <= 1e-2, f"seed={seed}"


@pytest.mark.parametrize("L", [1, 5, 1024])
def test_forward_in_cuda_graph(L, seed):
    """The forward captured once replays with new inputs and new routing of the same shapes,
    at decode sizes (the decode tiles) and above."""
    static = _cuda_layer(seed, L)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_experts(**static)  # warm up (compiles the kernels) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(**static)
    for step in range(3):  # new inputs, new routing, same shapes
        fresh = _cuda_layer(seed + 1 + step, L)
        for k in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down"):
            static[k].copy_(fresh[k])
        graph.replay()
        assert rel_err(out, _reference(fresh)) <= 1e-2, f"replay {step} seed={seed}"


# ----------------------------------------------------------------------------- backward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu", "gelu"])
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_backward(dtype, activation, layout, seed):
    check_backward(512, 256, 192, 8, 2, dtype=dtype, device="cuda", seed=seed, activation=activation,
                   layout=layout, bias=layout != "concatenated", tw_dtype=torch.float32)


@pytest.mark.parametrize(
    "L,E,K,routing,sentinel_frac",
    [(2048, 16, 2, "skewed", 0.0), (2048, 8, 1, "first", 0.0), (2048, 9, 2, "no_last", 0.0),
     (2048, 256, 8, "uniform", 0.0), (1, 8, 2, "uniform", 0.0), (1024, 8, 2, "uniform", 0.3)],
)
def test_backward_routings(L, E, K, routing, sentinel_frac, seed):
    check_backward(L, 256, 128, E, K, dtype=torch.bfloat16, device="cuda", seed=seed, routing=routing,
                   sentinel_frac=sentinel_frac, bias=True)


@pytest.mark.parametrize("d,I", [(2880, 1408), (200, 100)])
def test_backward_odd_sizes(d, I, seed):
    check_backward(777, d, I, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, tw_dtype=torch.float32,
                   layout="transposed_interleaved" if d == 2880 else "concatenated")


@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_recompute_backward(layout, seed):
    check_backward(777, 256, 192, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout=layout,
                   bias=True, tw_dtype=torch.float32, recompute=True)


@pytest.mark.parametrize("trainable", [("x", "topk_weights"), ("w_gate_up", "w_down", "b_gate_up", "b_down")])
def test_backward_skips_frozen(trainable, seed):
    check_frozen_grads(777, 256, 192, 8, 2, trainable=trainable, dtype=torch.bfloat16, device="cuda", seed=seed)


def test_forward_backward_without_host_sync(seed):
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


def test_training_step_in_cuda_graph(seed):
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


@pytest.mark.parametrize("family", ["one_hot", "sorted"])
@pytest.mark.parametrize("K", [1, 2, 3, 8])
def test_invalid_id_flags(K, family, seed, monkeypatch):
    """The device-side id check, folded into the dispatch kernels of either family: flags
    raised exactly for negative and repeated ids, also in a token whose K rows straddle the
    first chunk edge (K = 3), its bad id past the edge."""
    from moeblaze_ops.kernels.triton_backend.dispatch import _chunk_size, invalid_id_flags

    g = torch.Generator().manual_seed(seed)
    L, E = 4096, 64
    ids = make_topk_ids(L, K, E, generator=g)
    _patch_config(monkeypatch, DISPATCH_FAMILIES[family])
    edge = config.DISPATCH_SORT_CHUNK if family == "sorted" else _chunk_size(L * K)
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


@pytest.mark.parametrize("weights", ["tma", "pointer"])
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_weight_tma(layout, weights, seed, monkeypatch):
    """The ``tl`` GEMMs (fp32 here: no Gluon kernel takes it) with their weight tiles through
    TMA descriptors in every GEMM that reads them so (``config.WEIGHT_TMA_KINDS``: up, dH,
    dX; large GEMMs, as ``SMALL_GEMM_FLOP`` 0 makes these), or by pointer (small GEMMs, the
    rule at these sizes): forward and every gradient match the reference."""
    if weights == "pointer":
        monkeypatch.setattr(config, "SMALL_GEMM_FLOP", SMALL_GEMM_FLOP)
    check_forward(777, 2880, 1408, 8, 2, dtype=torch.float32, device="cuda", seed=seed, layout=layout,
                  bias=True, tw_dtype=torch.float32)
    check_backward(777, 256, 192, 8, 2, dtype=torch.float32, device="cuda", seed=seed, layout=layout,
                   bias=True, tw_dtype=torch.float32)


#: Each side of the kernel configuration's rules at these tests' sizes (777 tokens, K = 2,
#: E = 8: 194 routed rows an expert), as the ``kernels.config`` constants that put them
#: there: every GEMM on Gluon (the fixture's), with the Gluon row GEMMs warp-specialised;
#: every GEMM on its ``tl`` kernel (small GEMMs), dH there on its wide tile.
KERNEL_CHOICES = {
    "gluon_pipelined": {},
    "gluon_warp_specialized": dict(WARP_SPECIALIZE_MIN_ROWS=0),
    "tl": dict(SMALL_GEMM_FLOP=SMALL_GEMM_FLOP),
    "tl_dh_wide": dict(SMALL_GEMM_FLOP=SMALL_GEMM_FLOP, DH_WIDE_MIN_COLUMNS=0),
}


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
@pytest.mark.parametrize("activation,layout", [("swiglu", "interleaved"), ("clamped_swiglu", "transposed"),
                                               ("silu", "concatenated")])
def test_kernel_choices(choice, activation, layout, seed, monkeypatch):
    """Both sides of the rules that pick a kernel (``KERNEL_CHOICES``): the Gluon row GEMMs
    pipelined or warp-specialised, every GEMM on Gluon or on ``tl`` (whose dH epilogue
    goes in 2 slices on the "dh" tile, in 4 on the wide one): forward and every gradient
    against the reference."""
    _patch_config(monkeypatch, KERNEL_CHOICES[choice])
    check_forward(777, 512, 384, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, activation=activation,
                  layout=layout, bias=True, tw_dtype=torch.float32)
    check_backward(777, 256, 192, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, activation=activation,
                   layout=layout, bias=True, tw_dtype=torch.float32)


#: The up projection's routes without h: the Gluon GEMM's gated epilogue on either kernel,
#: or (small GEMMs) the ``tl`` GEMM then the activation pass.
UP_ROUTES = {"warp_specialized": dict(WARP_SPECIALIZE_MIN_ROWS=0), "pipelined": {},
             "tl": dict(SMALL_GEMM_FLOP=SMALL_GEMM_FLOP)}


@pytest.mark.parametrize("route", UP_ROUTES)
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "clamped_swiglu"])
def test_forward_activation_routes(activation, route, seed, monkeypatch):
    """The forward without gradients (act(h) from the up projection, h never made): from
    the Gluon up GEMM's epilogue on Hopper, each kernel, or the GEMM then the pass
    (``UP_ROUTES``): against the reference."""
    _patch_config(monkeypatch, UP_ROUTES[route])
    check_forward(777, 512, 384, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, activation=activation,
                  tw_dtype=torch.float32)


@pytest.mark.parametrize("route", ["warp_specialized", "pipelined"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "clamped_swiglu"])
def test_activation_beside_h(activation, route, seed, monkeypatch):
    """``config.activation_beside_h`` holding (I = 384; 194 rows an expert, with the rule's
    row bound at 0): the Gluon up GEMM's epilogue writes h and act(h) (each kernel) and the
    down projection reads act(h), running no activation pass; the forward of a
    differentiated layer and every gradient against the reference."""
    from moeblaze_ops.kernels.triton_backend import experts as triton_experts

    passes = []
    pass_kernel = triton_experts.launch_activation
    monkeypatch.setattr(triton_experts, "launch_activation", lambda *args: (passes.append(args), pass_kernel(*args)))
    _patch_config(monkeypatch, dict(UP_ROUTES[route], ACTIVATION_BESIDE_H_MIN_ROWS=0))
    assert config.activation_beside_h(384, 777 * 2, 8)
    check_forward(777, 512, 384, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, activation=activation,
                  tw_dtype=torch.float32, differentiated=True)
    assert not passes
    check_backward(777, 256, 384, 8, 2, dtype=torch.bfloat16, device="cuda", seed=seed, activation=activation,
                   tw_dtype=torch.float32)
    assert not passes


def test_activation_beside_h_peak(seed, monkeypatch):
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

    assert not config.activation_beside_h(1024, 4096 * 4, 16)  # 1024 rows an expert: below the rule's bound
    apart = peak()
    monkeypatch.setattr(config, "ACTIVATION_BESIDE_H_MIN_ROWS", 0)
    beside = peak()
    assert beside <= apart * 1.02, (beside, apart)


@pytest.mark.parametrize("slab", [1024, None], ids=["slabs_1024", "no_slabs"])
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_column_slabs(layout, slab, seed, monkeypatch):
    """The [L*K, d] scratch made in column slabs (1024 of d = 2880: two whole slabs and a
    partial one; 18000 routed rows over 2 experts leave the weight gradients' bytes no room
    to widen them) and in one piece (None): forward and every gradient against the
    reference, and the slabs the kernels made are those."""
    from moeblaze_ops.kernels.triton_backend import combine as triton_combine

    made = []
    real = triton_combine.column_slabs
    monkeypatch.setattr(triton_combine, "column_slabs", lambda d, widest=0: made.append(real(d, widest)) or made[-1])
    with settings.override(column_slab=slab):
        check_forward(9000, 2880, 1408, 2, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout=layout,
                      bias=True, tw_dtype=torch.float32)
        check_backward(9000, 2880, 192, 2, 2, dtype=torch.bfloat16, device="cuda", seed=seed, layout=layout,
                       bias=True, tw_dtype=torch.float32)
    expected = [(0, 1024), (1024, 2048), (2048, 2880)] if slab else [(0, 2880)]
    assert made and all(slabs == expected for slabs in made), made


@pytest.mark.parametrize("tile,slices", [(GemmTile(64, 64, 32, 4, 3), 1), (GemmTile(128, 128, 64, 8, 4), 2),
                                         (GemmTile(128, 256, 64, 8, 3), 4)], ids=["whole", "halves", "quarters"])
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu", "silu"])
def test_dh_epilogue(activation, tile, slices, seed, monkeypatch):
    """The ``tl`` dH epilogue (small GEMMs, as the rule has them at these sizes) in column
    slices of ``config.DH_EPILOGUE_COLUMNS``: over a 64-column tile whole, a 128-column one
    in halves, a 256-column one in quarters, with the approximate-tanh sigmoid: every
    gradient within the bf16 tolerance of the reference."""
    monkeypatch.setattr(config, "SMALL_GEMM_FLOP", SMALL_GEMM_FLOP)
    assert config.dh_epilogue_slices(tile.block_n) == slices
    with settings.override(tiles={"dh": tile}):
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


#: The weight gradient's kernels: (GEMM kind, tile; None: the kernel's own). The Gluon
#: kernel with its MMA warpgroups split ("wgrad_up", ``config.wgrad_split_mma``) or one
#: partition ("wgrad_down"), each with output tiles stored in halves or (three stages)
#: whole, and on one MMA warpgroup; the portable tl one (small GEMMs, as the rule has these).
WGRAD_VARIANTS = {
    "gluon_split": ("wgrad_up", None),
    "gluon": ("wgrad_down", None),
    "gluon_split_whole": ("wgrad_up", GemmTile(256, 128, 64, 8, 3)),
    "gluon_whole": ("wgrad_down", GemmTile(256, 128, 64, 8, 3)),
    "gluon_one_warpgroup": ("wgrad_up", GemmTile(256, 64, 64, 4, 4)),
    "tl": ("wgrad_up", None),
}


def _launch_wgrad(variant, monkeypatch, rows, gathered, ids, offsets, out):
    """``launch_wgrad`` on weight-gradient kernel ``variant`` (of ``WGRAD_VARIANTS``);
    returns how many times the Gluon kernel was launched."""
    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad
    from moeblaze_ops.kernels.triton_backend.experts_backward import launch_wgrad

    kind, tile = WGRAD_VARIANTS[variant]
    launches = []
    gluon_launch = gluon_wgrad.launch_wgrad
    with monkeypatch.context() as patch:
        patch.setattr(gluon_wgrad, "launch_wgrad", lambda *args, **kwargs: (launches.append(args),
                                                                              gluon_launch(*args, **kwargs)))
        if variant == "tl":
            patch.setattr(config, "SMALL_GEMM_FLOP", SMALL_GEMM_FLOP)
        with settings.override(tiles={kind: tile} if tile is not None else {}):
            launch_wgrad(rows, gathered, ids, offsets, out, kind=kind)
    assert bool(launches) == (variant != "tl"), f"{variant}: {len(launches)} Gluon launches"
    return len(launches)


@pytest.mark.parametrize("variant", WGRAD_VARIANTS)
@pytest.mark.parametrize("P,Q,transposed_out", [(192, 2880, False), (1408, 256, True), (64, 16, False)])
def test_weight_gradient_kernels(variant, P, Q, transposed_out, seed, monkeypatch):
    """Every weight-gradient kernel (``WGRAD_VARIANTS``): out[e] = A_e^T B[ids_e] against a
    float64 reference, with ragged and empty experts, tiles that run past P and Q, a
    transposed output view, output tiles by TMA copies in both orientations of the gradient
    where a program has more than one tile (in halves or whole; from registers at P=64,
    Q=16, one tile a program), a poisoned output (a tile the order skipped stays NaN), and
    two runs bitwise equal."""
    from moeblaze_ops.kernels.triton_backend.gluon import common as gluon_common
    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad
    from moeblaze_ops.kernels.triton_backend import grouped_gemm

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
        _launch_wgrad(variant, monkeypatch, rows, gathered, ids, offsets, view)
        kind, tile = WGRAD_VARIANTS[variant]
        tile = tile or gluon_wgrad.TILE
        tiles = E * grouped_gemm.cdiv(P, tile.block_m) * grouped_gemm.cdiv(Q, tile.block_n)
        if variant != "tl" and tiles > grouped_gemm.num_programs(view.device, tiles):
            # Stored by TMA here (whole tiles where named), not from registers.
            groups = 2 if config.wgrad_split_mma(kind) and tile.num_warps == 8 else 1
            pieces = gluon_common.store_pieces(tile, view.element_size(), view.device)
            # The named whole-tile variants, and the one-warpgroup tile ((256 + 64) x 64 x 4 stages
            # beside a whole 256 x 64 tile: 192 KB), store whole tiles; the default tiles in halves.
            assert pieces == (1 if variant.endswith("whole") or variant == "gluon_one_warpgroup" else 2)
            assert gluon_wgrad._output_descriptor(view, tile, pieces, groups)[0] is not None
        return view

    out = run()
    bounds = offsets.tolist()
    ref = torch.stack([rows[lo:hi].double().T @ gathered[ids[lo:hi].long()].double()
                       for lo, hi in zip(bounds[:-1], bounds[1:])])
    assert rel_err(out, ref) <= 1e-2, f"seed={seed}"
    assert out[5].eq(0).all(), "an empty expert's gradient is zero"
    assert torch.equal(out, run()), "two runs differ"


@pytest.mark.parametrize("variant", ["gluon_split", "gluon"])
def test_weight_gradient_tile_orders(variant, seed, monkeypatch):
    """The Gluon weight gradient with experts above ``config.wgrad_long_rows`` (tiles in
    bands of ``WGRAD_LONG_BAND`` P-tiles, here 10 P-tiles: a whole band and a partial one)
    beside experts below it (Q-tiles fastest): against a float64 reference, every tile
    written (a poisoned output), and bitwise equal to the kernel with every expert in the
    one order, since the order moves no tile's sum."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, LK, T, P, Q = 6, 2400, 700, 2336, 272
    cuts = torch.sort(torch.randint(0, LK, (E - 1,), device="cuda", generator=g)).values
    offsets = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), LK)]).to(torch.int32)
    rows = torch.randn(LK, P, device="cuda", dtype=torch.bfloat16, generator=g)
    gathered = torch.randn(T, Q, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(0, T, (LK,), device="cuda", dtype=torch.int32, generator=g)
    sizes = (offsets[1:] - offsets[:-1]).tolist()
    middle = sorted(sizes)[E // 2]

    def run(long_rows):
        out = torch.full((E, P, Q), float("nan"), device="cuda", dtype=torch.bfloat16)
        with monkeypatch.context() as patch:
            patch.setattr(config, "wgrad_long_rows", lambda *args: long_rows)
            _launch_wgrad(variant, monkeypatch, rows, gathered, ids, offsets, out)
        return out

    out = run(middle)
    bounds = offsets.tolist()
    ref = torch.stack([rows[lo:hi].double().T @ gathered[ids[lo:hi].long()].double()
                       for lo, hi in zip(bounds[:-1], bounds[1:])])
    assert any(n > middle for n in sizes) and any(n <= middle for n in sizes)
    assert rel_err(out, ref) <= 1e-2, f"seed={seed}"
    assert torch.equal(out, run(0)) and torch.equal(out, run(LK)), f"seed={seed}: the tile order moved a sum"


@pytest.mark.parametrize("variant", WGRAD_VARIANTS)
def test_weight_gradients_keep_experts_apart(variant, seed, monkeypatch):
    """An infinite row of one expert's operand reaches that expert's gradient alone: the
    rows past an expert's end that its last step covers are masked, so the next expert's
    values never meet its sum, not even as inf * 0 (which a kernel that read whole steps
    and relied on the zero-filled gathered rows would let through)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, LK, T, P, Q = 8, 1000, 300, 128, 256
    # Expert sizes that are not multiples of the 64-row steps; expert 3 starts mid-step.
    offsets = torch.tensor([0, 100, 230, 301, 470, 600, 777, 900, LK], device="cuda", dtype=torch.int32)
    rows = torch.randn(LK, P, device="cuda", dtype=torch.bfloat16, generator=g)
    rows[301] = float("inf")  # expert 3's first row, inside expert 2's last step
    gathered = torch.randn(T, Q, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(0, T, (LK,), device="cuda", dtype=torch.int32, generator=g)
    out = torch.full((E, P, Q), float("nan"), device="cuda", dtype=torch.bfloat16)
    _launch_wgrad(variant, monkeypatch, rows, gathered, ids, offsets, out)
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
def test_launch_plans_equal_the_jit_bitwise(aligned, seed, monkeypatch):
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
    from moeblaze_ops.kernels import launch as plans

    with monkeypatch.context() as patch:  # no kernel has a plan: every launch takes the JIT's path
        patch.setattr(plans, "kernel_signature", lambda kernel: None)
        want = [step(layer) for layer in layers]
    for _ in range(2):
        for layer, expected in zip(layers, want):
            for got, ref in zip(step(layer), expected):
                assert torch.equal(got, ref), f"seed={seed}"


@pytest.mark.parametrize("T", [1, 3, 8, 37, 64])
@pytest.mark.parametrize("case", ["swiglu", "clamped_swiglu_interleaved_bias", "gelu_sentinels"])
def test_decode_forward(T, case, seed):
    """Forwards of decode size (few routed rows per expert: the table's "few_rows" and
    "some_rows" tiles of the up and down GEMMs, for T = 1..64 over 16 experts, top 4),
    without and with gradients, against the float64 reference; outputs poisoned."""
    rows_classes = {config.rows_class(t * 4, 16) for t in (1, 3, 8, 37, 64)}
    assert rows_classes == {"few_rows", "some_rows"}
    activation = case.split("_interleaved")[0].split("_sentinels")[0]
    kwargs = dict(activation=activation, layout="interleaved" if "interleaved" in case else "concatenated",
                  bias="bias" in case, sentinel_frac=0.25 if "sentinels" in case else 0.0)
    with settings.override(poison=True):
        for differentiated in (False, True):
            check_forward(T, 256, 384, 16, 4, dtype=torch.bfloat16, device="cuda", seed=seed,
                          tw_dtype=torch.float32, differentiated=differentiated, **kwargs)
