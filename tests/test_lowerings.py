"""The Inductor lowerings (``moeblaze_ops.lowerings``): registered on import, falling back to
the ops' own kernels where the templates do not apply (CPU, here in CI), and on the GPU
compiled into template kernels whose epilogue takes the layer's pointwise consumers."""

import re
import subprocess
import sys

import pytest
import torch

from moeblaze_ops import moe_experts, settings
from moeblaze_ops.kernels import config
from moeblaze_ops.testing import make_layer, rel_err

LAYER_ARGS = ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")
GRAD_ARGS = ("x", "topk_weights", "w_gate_up", "w_down")
#: What each template's kernel source imports: the eager kernels' tile functions.
# A layer without gradients: the up GEMM with its activation, the down GEMM, the combine.
TEMPLATE_HELPERS = ("import activated_gemm_tile", "import gathered_gemm_tile", "import combine_tile")


def gpu(test):
    """A GPU test: marked ``gpu`` (scripts/gpu_check.sh selects them) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@pytest.fixture(autouse=True)
def fresh_compiles():
    """Every test compiles afresh: Inductor's FX graph cache does not key on the lowerings'
    code (the settings are in its key, ``settings.override``), so a disk cache from before a
    change of a template would otherwise run."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False):
        yield


def residual_moe(x, topk_ids, topk_weights, w_gate_up, w_down, residual):
    return residual + moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down)


def test_registered_when_inductor_is_imported():
    """``import moeblaze_ops`` registers nothing with Inductor and does not import it;
    the lowerings are in Inductor's table once its lowering module is imported."""
    code = ("import sys, torch, moeblaze_ops\n"
            "assert 'torch._inductor.lowering' not in sys.modules\n"
            "from torch._inductor.lowering import lowerings\n"
            "ops = torch.ops.moeblaze\n"
            "assert ops.expert_up.default in lowerings and ops.expert_down.default in lowerings\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize("first", ["moeblaze_ops.lowerings.templates", "moeblaze_ops.lowerings.compat"])
def test_registered_when_a_submodule_is_imported_first(first):
    """Importing one of the lowering modules before Inductor registers every lowering,
    without the registration warning (compat imports Inductor's table, whose import hook
    registers the lowerings: compat must not be half-imported then)."""
    code = ("import importlib, warnings, torch, moeblaze_ops\n"
            "warnings.simplefilter('error', RuntimeWarning)\n"
            f"importlib.import_module({first!r})\n"
            "from torch._inductor.lowering import lowerings\n"
            "ops = torch.ops.moeblaze\n"
            "assert all(op.default in lowerings for op in (ops.expert_up, ops.expert_down, ops.expert_up_backward,\n"
            "                                              ops.expert_down_backward))\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def _render(template, **variables):
    """A template's kernel source with stand-ins for Inductor's hooks (``def_kernel``,
    ``size``, ``stride``, ``store_output``), as Python text."""
    hooks = dict(def_kernel=lambda *names: f"def kernel({', '.join(names)}):",
                 size=lambda name, dim: f"size_{name}_{dim}", stride=lambda name, dim: f"stride_{name}_{dim}",
                 store_output=lambda *args, **kwargs: "store(idx_m, idx_n, acc, mask)")
    return template.template.render(**hooks, **variables)


@pytest.mark.parametrize("variables", [
    dict(GATHER_A=g, HAS_BIAS=b, B_TMA=t, B_KMAJOR=k, TRANSPOSED=tr) for g in (False, True) for b in (False, True)
    for t, k in ((False, True), (True, True), (True, False)) for tr in (False, True)], ids=str)
def test_row_gemm_template_renders(variables):
    """Every variant of the row GEMM template renders to Python that parses, with the
    kernel arguments its variant needs and no other."""
    import ast

    from moeblaze_ops.lowerings import templates

    source = _render(templates.row_gemm, **variables)
    ast.parse(source)
    signature = re.search(r"def kernel\((.*)\):", source).group(1).split(", ")
    assert ("a_row_ids_ptr" in signature) == variables["GATHER_A"]
    assert ("bias_ptr" in signature) == variables["HAS_BIAS"]
    assert ("make_tensor_descriptor" in source) == variables["B_TMA"]
    # The template's call of the kernels' shared tile function passes each of its parameters.
    from moeblaze_ops.kernels.triton_backend.experts import gathered_gemm_tile

    call = next(node for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "gathered_gemm_tile")
    assert len(call.args) == len(gathered_gemm_tile.arg_names)


@pytest.mark.parametrize("variables", [dict(HAS_BIAS=b, TRANSPOSED=t) for b in (False, True) for t in (False, True)],
                         ids=str)
def test_activated_row_gemm_template_renders(variables):
    """The up GEMM template with its activation renders to Python that parses, takes the
    bias only where it has one, and passes every parameter of the kernels' shared tile
    function."""
    import ast

    from moeblaze_ops.kernels.triton_backend.experts import activated_gemm_tile
    from moeblaze_ops.lowerings import templates

    source = _render(templates.activated_row_gemm, **variables)
    signature = re.search(r"def kernel\((.*)\):", source).group(1).split(", ")
    assert ("bias_ptr" in signature) == variables["HAS_BIAS"]
    call = next(node for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "activated_gemm_tile")
    assert len(call.args) == len(activated_gemm_tile.arg_names)


@pytest.mark.parametrize("weighted", [True, False])
def test_combine_template_renders(weighted):
    """The combine template, weighted (the forward) and not (the input gradient), renders
    to Python that parses; unweighted, it takes and reads no weights."""
    import ast

    from moeblaze_ops.lowerings import templates

    source = _render(templates.combine, WEIGHTED=weighted)
    ast.parse(source)
    assert ("weights_ptr" in source) == weighted


class _CudaNode:
    """The two questions ``_op_runs_gluon`` asks an IR node, answered as for a bf16 CUDA tensor."""

    def get_device(self):
        return torch.device("cuda", 0)

    def get_dtype(self):
        return torch.bfloat16


class _Weights:
    """A stand-in for a weight stack's IR node: its sizes alone."""

    def __init__(self, *sizes):
        self.sizes = sizes

    def get_size(self):
        return list(self.sizes)


@pytest.mark.parametrize("kind,out_cols,reduction,experts,expected", [
    ("up", 1024, 512, 1, True), ("up", 1000, 512, 1, False), ("up", 1024, 520, 1, False),
    ("down", 2880, 1408, 1, True),  # slabs of 512 columns
    ("down", 2048, 1400, 1, False),
    ("down", 2888, 1408, 1, True),  # a 512-column slab: a multiple of 16 ...
    ("down", 2888, 1408, 64, False),  # ... widened to all 2888 columns (the weights leave room): not one
])
def test_op_called_only_where_its_gluon_kernel_takes_the_shape(kind, out_cols, reduction, experts, expected,
                                                               monkeypatch):
    """The lowerings call the op instead of a template where the op would run its GEMM on
    Gluon, and only for column counts the Gluon kernel takes (multiples of 16; for down
    and dX those of a column slab, widened as the op widens it): elsewhere the op would
    run its ``tl`` kernel, and the template, as fast, lets consumers fuse. The GPU checks
    stand in (Hopper, the Gluon module chosen)."""
    pytest.importorskip("triton.experimental.gluon")
    from moeblaze_ops.kernels.triton_backend.gluon import common as gluon_common
    from moeblaze_ops.lowerings import expert_ops

    monkeypatch.setattr(expert_ops.gg, "gluon_module", lambda kind, flop: object())
    monkeypatch.setattr(gluon_common, "is_hopper", lambda index: True)
    monkeypatch.setattr(expert_ops.compat, "hint", int)  # concrete sizes: no graph being lowered
    weights = _Weights(experts, out_cols, reduction) if kind != "up" else None
    assert expert_ops._op_runs_gluon(kind, _CudaNode(), 8192, out_cols, reduction, weights) is expected


@pytest.mark.slow
def test_cpu_falls_back_to_the_ops(seed):
    """On CPU the lowering calls the ops themselves: the compiled graph (nothing to
    differentiate) calls ``dispatch`` and ``expert_layer``, and matches eager."""
    from torch._inductor.utils import run_and_get_code

    layer = make_layer(24, 16, 8, 4, 2, seed=seed)
    residual = torch.randn_like(layer["x"])
    args = [layer[k] for k in LAYER_ARGS] + [residual]
    torch._dynamo.reset()
    out, (code,) = run_and_get_code(torch.compile(residual_moe, fullgraph=True), *args)
    called = {"expert_layer", "dispatch"}
    for op in ("expert_layer", "dispatch", "expert_up", "expert_down"):
        assert (f"torch.ops.moeblaze.{op}.default(" in code) == (op in called), op
    assert rel_err(out, residual_moe(*args)) < 1e-6


@pytest.mark.slow
def test_compiled_graphs_check_index_arrays_they_are_given(seed):
    """Index arrays a compiled graph takes as inputs (not made by a dispatch of its own)
    have their values checked by the ops, as in eager: offsets that run past the rows
    raise. Valid ones match eager."""
    layer = make_layer(24, 16, 8, 4, 2, seed=seed)
    ops = torch.ops.moeblaze
    eti, offsets, tim = ops.dispatch(layer["topk_ids"], 4)

    def given_arrays(x, w_gate_up, w_down, topk_weights, eti, offsets, tim):
        h = ops.expert_up(x, w_gate_up, eti, offsets, tim)
        return ops.expert_down(h, w_down, eti, offsets, tim, topk_weights)

    tensors = [layer[k] for k in ("x", "w_gate_up", "w_down", "topk_weights")]
    torch._dynamo.reset()
    compiled = torch.compile(given_arrays, fullgraph=True)
    assert rel_err(compiled(*tensors, eti, offsets, tim), given_arrays(*tensors, eti, offsets, tim)) < 1e-6
    bad = offsets.clone()
    bad[2] = eti.shape[0] + 5
    with pytest.raises(ValueError, match="expert_offsets"):
        compiled(*tensors, eti, bad, tim)


def _loss(x, topk_ids, topk_weights, w_gate_up, w_down):
    out = moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down)
    return (out.float() ** 2).mean()


def _grads(fn, layer, **backward_kwargs):
    args = {k: layer[k].detach().clone().requires_grad_(k in GRAD_ARGS) for k in LAYER_ARGS}
    loss = fn(**args)
    loss.backward(**backward_kwargs)
    return loss, [args[k].grad for k in GRAD_ARGS]


@pytest.mark.slow
def test_compiled_backward_writes_dh_over_h(seed):
    """The compiled backward runs the in-place form of expert_down_backward on the h that
    AOTAutograd donated to it (h and dH never both exist, as in eager), with eager's
    gradients; a second backward through that graph is refused rather than reading the
    overwritten h."""
    from torch._inductor.utils import run_and_get_code

    layer = make_layer(24, 16, 8, 4, 2, seed=seed)
    torch._dynamo.reset()
    compiled = torch.compile(_loss, fullgraph=True)
    (_, grads), codes = run_and_get_code(lambda: _grads(compiled, layer))
    for op in ("expert_down_backward_", "expert_up_backward", "dispatch"):
        assert any(f"torch.ops.moeblaze.{op}.default(" in code for code in codes), op
    assert not any("torch.ops.moeblaze.expert_down_backward.default(" in code for code in codes)
    for g, ref in zip(grads, _grads(_loss, layer)[1]):
        assert rel_err(g, ref) < 1e-6
    with pytest.raises(RuntimeError, match="retain_graph"):
        _grads(compiled, layer, retain_graph=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["beside_h", "too_wide", "below_min_rows", "up_bias", "interleaved"])
def test_compiled_training_plans_activation_beside_h(case, seed, monkeypatch):
    """Where the up projection runs as the op and ``config.activation_beside_h`` holds for
    the size hints (a gated activation over concatenated halves, no up bias), the compiled
    forward calls ``_expert_up_beside`` (h and act(h)) and ``_expert_down_activated`` (no
    activation pass), as eager training does; elsewhere ``expert_up`` and
    ``expert_down``. The backward still writes dH over h, and every gradient matches
    eager's."""
    from torch._inductor.utils import run_and_get_code

    layer = make_layer(24, 16, 8, 4, 2, seed=seed, bias=case == "up_bias",
                       **({"activation": "clamped_swiglu", "interleaved": True} if case == "interleaved" else {}))
    names = [k for k in (*LAYER_ARGS, "b_gate_up", "activation", "interleaved") if k in layer]
    trainable = [k for k in ("x", "topk_weights", "w_gate_up", "w_down", "b_gate_up") if layer.get(k) is not None]

    def loss(inputs):
        return (moe_experts(**inputs).float() ** 2).mean()

    def grads(fn):
        inputs = {k: (layer[k].detach().clone().requires_grad_(k in trainable)
                      if isinstance(layer[k], torch.Tensor) else layer[k]) for k in names}
        fn(inputs).backward()
        return [inputs[k].grad for k in trainable]

    # 48 routed rows over 4 experts: 12 a expert; I = 8
    monkeypatch.setattr(config, "ACTIVATION_BESIDE_H_MIN_ROWS", 13 if case == "below_min_rows" else 0)
    monkeypatch.setattr(config, "ACTIVATION_BESIDE_H_MAX_COLUMNS", 4 if case == "too_wide" else 8)
    torch._dynamo.reset()
    got, codes = run_and_get_code(lambda: grads(torch.compile(loss, fullgraph=True)))
    code = "\n".join(codes)
    beside = case == "beside_h"
    for op, called in (("_expert_up_beside", beside), ("_expert_down_activated", beside),
                       ("expert_up", not beside), ("expert_down", not beside), ("expert_down_backward_", True)):
        assert (f"torch.ops.moeblaze.{op}.default(" in code) == called, op
    for name, g, ref in zip(trainable, got, grads(loss)):
        assert rel_err(g, ref) < 1e-6, name


# --------------------------------------------------------------------------- GPU: the templates


def _gpu_layer(seed, L=300, d=256, I=192, E=8, K=2, dtype=torch.bfloat16, **kwargs):
    layer = make_layer(L, d, I, E, K, dtype=dtype, seed=seed, **kwargs)
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in layer.items()}


def _reference(layer, residual=None):
    """The float64 layer on the CPU (``moe_experts`` runs the portable kernels there)."""
    args = {k: (v.detach().cpu().double() if isinstance(v, torch.Tensor) and v.is_floating_point() else
                v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in layer.items()}
    out = moe_experts(**args)
    return (out if residual is None else out + residual.cpu().double()).cuda()


def _compiled_code(fn, *args, **compile_kwargs):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(fn, fullgraph=True, **compile_kwargs), *args)
    return out, "\n".join(codes)


def _narrow_slabs(monkeypatch):
    """Column slabs of ``settings.column_slab`` exactly, not widened to the weights' room."""
    from moeblaze_ops.lowerings import expert_ops

    monkeypatch.setattr(expert_ops, "widest_slab", lambda *args, **kwargs: 0)


def _tl_kernels_only(monkeypatch):
    """Every GEMM counted small: the ``tl`` kernels and templates, no Gluon (any GPU)."""
    monkeypatch.setattr(config, "SMALL_GEMM_FLOP", 2**62)


def _gluon_from_any_size(monkeypatch):
    """No GEMM counted small: the Gluon kernels wherever they apply (Hopper)."""
    monkeypatch.setattr(config, "SMALL_GEMM_FLOP", 0)


@gpu
@pytest.mark.parametrize("column_slab,row_band", [(None, 1), (128, 1), (16, 1), (128, 3)])
def test_templates_run_the_layer(column_slab, row_band, seed, monkeypatch):
    """The compiled layer is made of the moeblaze templates (up GEMM with its activation,
    down GEMM, combine), with nothing falling back to the ops, and matches the float64 layer. With
    16 slabs (more than Inductor fuses into a pointwise cat) the slabs meet in a concat
    kernel, which Inductor's cat lowering makes when called from inside our lowering. With
    a band of 3 the row GEMM templates number their tiles in bands."""
    layer = _gpu_layer(seed)
    _narrow_slabs(monkeypatch)
    _tl_kernels_only(monkeypatch)
    monkeypatch.setattr(config, "ROW_BAND", row_band)
    with settings.override(column_slab=column_slab, poison=True):
        out, code = _compiled_code(moe_experts, *[layer[k] for k in LAYER_ARGS])
    for helper in TEMPLATE_HELPERS:
        assert helper in code
    for op in ("expert_up", "expert_down", "expert_layer"):
        assert f"torch.ops.moeblaze.{op}.default(" not in code, op
    assert rel_err(out, _reference(layer)) < 1e-2


@gpu
@pytest.mark.parametrize("up_epilogue", [True, False])
@pytest.mark.parametrize("case", ["swiglu", "clamped_interleaved_bias", "gelu_transposed"])
def test_layer_without_gradients_activates_in_the_up_template(case, up_epilogue, seed, monkeypatch):
    """Without gradients, where ``config.activates_in_up_epilogue`` says so the compiled
    layer's up GEMM template applies the activation (no h, no activation pass); elsewhere
    the up GEMM writes h and the activation template reads it. Both match the float64 layer."""
    kwargs = {"swiglu": {}, "clamped_interleaved_bias": dict(activation="clamped_swiglu", interleaved=True, bias=True),
              "gelu_transposed": dict(activation="gelu", transposed=True)}[case]
    layer = _gpu_layer(seed, **kwargs)
    _tl_kernels_only(monkeypatch)
    monkeypatch.setattr(config, "activates_in_up_epilogue", lambda flop: up_epilogue)
    with settings.override(poison=True):
        out, code = _compiled_code(lambda layer: moe_experts(**layer), layer)
    assert ("import activated_gemm_tile" in code) == up_epilogue
    assert ("activations import activate\n" in code) == (not up_epilogue)
    assert "torch.ops.moeblaze.expert_layer.default(" not in code
    assert rel_err(out, _reference(layer)) < 1e-2


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("gluon", [True, False])
def test_gemms_on_gluon_kernels_call_the_ops(gluon, seed, monkeypatch):
    """Where the op would run a GEMM on its Gluon kernel (Hopper, at least
    ``config.SMALL_GEMM_FLOP`` operations: here any), the compiled graph calls the op
    instead of a ``tl`` template, forward and backward (dX); with every GEMM counted
    small the same sizes run as templates. Either way the layer and its gradients match."""
    from torch._inductor.utils import run_and_get_code

    layer = _gpu_layer(seed)
    (_gluon_from_any_size if gluon else _tl_kernels_only)(monkeypatch)
    torch._dynamo.reset()
    (_, got), codes = run_and_get_code(lambda: _grads(torch.compile(_loss, fullgraph=True), layer))
    _, expected = _grads(_loss, layer)
    code = "\n".join(codes)
    assert ("torch.ops.moeblaze.expert_up.default(" in code) == gluon
    assert ("torch.ops.moeblaze.expert_down.default(" in code) == gluon
    assert ("import gathered_gemm_tile" in code) == (not gluon)  # no row GEMM template, forward or dX
    for name, g, ref in zip(GRAD_ARGS, got, expected):
        assert rel_err(g, ref) < 2e-2, name


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("gluon", [True, False])
def test_layer_without_gradients_on_gluon_calls_the_op(gluon, seed, monkeypatch):
    """Nothing to differentiate: where the up GEMM runs on its Gluon kernel, the compiled
    graph calls ``expert_layer`` (act(h) from that GEMM's epilogue, no h); with every GEMM
    counted small the same sizes run as the up and down templates. Either way the layer
    matches the float64 one."""
    layer = _gpu_layer(seed)
    (_gluon_from_any_size if gluon else _tl_kernels_only)(monkeypatch)
    with settings.override(poison=True):
        out, code = _compiled_code(moe_experts, *[layer[k] for k in LAYER_ARGS])
    assert ("torch.ops.moeblaze.expert_layer.default(" in code) == gluon
    assert ("import gathered_gemm_tile" in code) == (not gluon)
    assert rel_err(out, _reference(layer)) < 1e-2


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_compiled_training_writes_activation_beside_h(activation, seed, monkeypatch):
    """Compiled training with ``config.activation_beside_h`` holding (I = 384, the rows'
    bound 0) and the GEMMs on Gluon: the up GEMM's epilogue writes h and act(h), and no
    activation pass runs, in the forward or the backward; every gradient matches eager's
    (which takes the same route)."""
    from torch._inductor.utils import run_and_get_code

    from moeblaze_ops.kernels.triton_backend import experts as triton_experts

    passes = []
    pass_kernel = triton_experts.launch_activation
    monkeypatch.setattr(triton_experts, "launch_activation", lambda *args: (passes.append(args), pass_kernel(*args)))
    layer = _gpu_layer(seed, I=384, activation=activation)
    args = {k: layer[k] for k in (*LAYER_ARGS, "activation")}

    def grads(fn):
        inputs = {k: (v.detach().clone().requires_grad_(k in GRAD_ARGS) if isinstance(v, torch.Tensor) else v)
                  for k, v in args.items()}
        (fn(**inputs).float() ** 2).mean().backward()
        return [inputs[k].grad for k in GRAD_ARGS]

    _gluon_from_any_size(monkeypatch)
    monkeypatch.setattr(config, "ACTIVATION_BESIDE_H_MIN_ROWS", 0)
    with settings.override(poison=True):
        torch._dynamo.reset()
        got, codes = run_and_get_code(lambda: grads(torch.compile(moe_experts, fullgraph=True)))
        assert not passes
        expected = grads(moe_experts)
    code = "\n".join(codes)
    assert "torch.ops.moeblaze._expert_up_beside.default(" in code
    assert "torch.ops.moeblaze._expert_down_activated.default(" in code
    for name, g, ref in zip(GRAD_ARGS, got, expected):
        assert rel_err(g, ref) < 2e-2, name


@gpu
def test_residual_add_fuses_into_the_combine(seed):
    """``residual + moe(x)`` with one column slab: the add runs in the combine template's
    epilogue, so the graph has no pointwise kernel of its own."""
    layer = _gpu_layer(seed)
    residual = torch.randn_like(layer["x"])
    with settings.override(column_slab=None):
        out, code = _compiled_code(residual_moe, *[layer[k] for k in LAYER_ARGS], residual)
    assert re.search(r"def triton_tem_fused_add_expert_(down|layer)\w*\(", code)  # the combine, with the add
    assert "triton_poi" not in code and "triton_red" not in code
    assert rel_err(out, _reference(layer, residual)) < 1e-2


@gpu
@pytest.mark.parametrize("case", ["bias_transposed", "clamped_interleaved", "fp32", "sentinels_empty_experts"])
def test_templates_cover_the_layer_variants(case, seed):
    kwargs = {"bias_transposed": dict(bias=True, transposed=True),
              "clamped_interleaved": dict(activation="clamped_swiglu", interleaved=True),
              "fp32": dict(dtype=torch.float32),
              "sentinels_empty_experts": dict(E=16, routing="skewed", sentinel_frac=0.2)}[case]
    layer = _gpu_layer(seed, **kwargs)
    with settings.override(poison=True):
        out, code = _compiled_code(lambda layer: moe_experts(**layer), layer)
    assert TEMPLATE_HELPERS[0] in code
    tol = 1e-5 if kwargs.get("dtype") == torch.float32 else 1e-2
    assert rel_err(out, _reference(layer)) < tol


@gpu
def test_compiled_training_step_matches_eager(seed):
    """Forward and backward through the compiled layer (dynamic token count, two sizes):
    the gradients match eager's."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_loss, backend=counter, fullgraph=True, dynamic=True)
    for L in (200, 333):
        layer = _gpu_layer(seed + L, L=L)
        for g, ref in zip(_grads(compiled, layer)[1], _grads(_loss, layer)[1]):
            assert rel_err(g, ref) < 2e-2
    assert counter.frame_count == 1  # the templates' guards (E, K, d) hold across token counts


@gpu
@pytest.mark.parametrize("case", ["one_slab", "slabs_bias_transposed", "frozen_experts"])
def test_dx_template_in_the_compiled_backward(case, seed, monkeypatch):
    """Where dX runs no Gluon kernel, the compiled backward computes grad_x with the
    row_gemm and unweighted combine templates (the op runs for the weight gradients
    alone), and every gradient matches eager's."""
    from torch._inductor.utils import run_and_get_code

    options = {"one_slab": dict(column_slab=None), "slabs_bias_transposed": dict(column_slab=128),
               "frozen_experts": dict(column_slab=128)}[case]
    _narrow_slabs(monkeypatch)
    _tl_kernels_only(monkeypatch)
    layer = _gpu_layer(seed, **(dict(bias=True, transposed=True) if case == "slabs_bias_transposed" else {}))
    weights = [k for k in ("w_gate_up", "w_down", "b_gate_up", "b_down") if layer[k] is not None]
    names = ["x", "topk_weights"] + ([] if case == "frozen_experts" else weights)

    def loss(inputs):
        return (moe_experts(**inputs).float() ** 2).mean()

    def grads(fn):
        inputs = {k: (v.detach().clone().requires_grad_(True) if k in names else v) for k, v in layer.items()}
        fn(inputs).backward()
        return [inputs[k].grad for k in names]

    with settings.override(**options):
        torch._dynamo.reset()
        got, codes = run_and_get_code(lambda: grads(torch.compile(loss, fullgraph=True)))
    assert "combine_tile(rows_ptr, tim_ptr, None" in "\n".join(codes)  # the unweighted combine of dX rows
    for name, g, ref in zip(names, got, grads(loss)):
        assert rel_err(g, ref) < 2e-2, name


@gpu
def test_hf_decoder_layer_compiles_to_templates(seed):
    """A tiny HF MoE decoder with the moeblaze experts backend, compiled: forward and
    backward match eager and the forward runs the moeblaze templates."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import moeblaze_ops.hf

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moeblaze_ops.hf.model_config("qwen3_moe", num_layers=1),
                                             experts_implementation="moeblaze").cuda().to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 64), device="cuda")

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids).logits.float().square().mean()
        loss.backward()
        return loss, [p.grad for p in model.parameters() if p.grad is not None]

    eager_loss, eager_grads = loss_and_grads(model)
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    (loss, grads), codes = run_and_get_code(lambda: loss_and_grads(compiled))
    code = "\n".join(codes)
    assert TEMPLATE_HELPERS[1] in code and TEMPLATE_HELPERS[2] in code  # training: the up GEMM writes h
    assert rel_err(loss, eager_loss) < 1e-2
    assert len(grads) == len(eager_grads)
    for g, ref in zip(grads, eager_grads):
        assert rel_err(g, ref) < 5e-2


@gpu
@pytest.mark.parametrize("beside_h", [False, True], ids=["activation_in_down", "activation_beside_h"])
def test_compiled_training_peak_at_most_eager(beside_h, seed, monkeypatch):
    """One compiled forward + backward peaks no higher than eager's: dH is written over h
    in both, and where the up GEMM's epilogue writes act(h) beside h
    (``config.activation_beside_h``) act(h) lives from the up projection to the down one
    in both."""
    layer = _gpu_layer(seed, L=4096, d=512, I=1024, E=16, K=4)
    torch._dynamo.reset()
    compiled = torch.compile(_loss, fullgraph=True)

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _grads(fn, layer)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    if beside_h:  # the GEMMs on Gluon, whose up epilogue writes act(h)
        _gluon_from_any_size(monkeypatch)
        monkeypatch.setattr(config, "ACTIVATION_BESIDE_H_MIN_ROWS", 0)
    _grads(compiled, layer)  # compiles
    assert peak(compiled) <= peak(_loss) * 1.02


@gpu
def test_max_autotune_compiles(seed):
    layer = _gpu_layer(seed)
    out, code = _compiled_code(moe_experts, *[layer[k] for k in LAYER_ARGS], mode="max-autotune-no-cudagraphs")
    assert TEMPLATE_HELPERS[0] in code
    assert rel_err(out, _reference(layer)) < 1e-2


@gpu
def test_reduce_overhead_records_cuda_graphs_without_syncs(seed):
    """mode="reduce-overhead": the graph is captured (an error otherwise), and no step syncs
    with the host."""
    import torch._inductor.config as inductor_config

    layer = _gpu_layer(seed)
    args = [layer[k] for k in LAYER_ARGS]
    torch._dynamo.reset()
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        fn = torch.compile(moe_experts, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):
            fn(*args)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert rel_err(out, _reference(layer)) < 1e-2
