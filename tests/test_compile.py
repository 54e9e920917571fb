"""torch.compile(fullgraph=True): no graph breaks, one compilation for several token counts."""

import pytest
import torch
import torch._dynamo.testing

from moeblaze_ops import moe_experts
from moeblaze_ops.testing import make_layer, rel_err

GRAD_ARGS = ("x", "topk_weights", "w_gate_up", "w_down")


def loss_fn(x, topk_ids, topk_weights, w_gate_up, w_down):
    out = moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, "swiglu")
    return (out.float() * out.float()).mean()


def _run(fn, layer, mark_dynamic=False):
    """Forward through ``fn`` (compiled or not) and backward through the graph it built."""
    args = {k: (v.detach().clone().requires_grad_(True) if k in GRAD_ARGS else v) for k, v in layer.items()
            if k in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")}
    if mark_dynamic:  # the token dimension
        for k in ("x", "topk_ids", "topk_weights"):
            torch._dynamo.mark_dynamic(args[k], 0)
    loss = fn(**args)
    loss.backward()
    return loss, [args[k].grad for k in GRAD_ARGS]


def _layers(Ls, seed):
    return [make_layer(L, 16, 8, 4, 2, seed=seed + L) for L in Ls]


def _assert_same(compiled_fn, layer, mark_dynamic=False):
    loss, grads = _run(compiled_fn, layer, mark_dynamic)
    ref_loss, ref_grads = _run(loss_fn, layer)
    assert rel_err(loss, ref_loss) < 1e-6
    for g, rg in zip(grads, ref_grads):
        assert rel_err(g, rg) < 1e-6


def test_no_graph_breaks(seed):
    layer = _layers([12], seed)[0]
    args = [layer[k] for k in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    explanation = torch._dynamo.explain(lambda *a: moe_experts(*a))(*args)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


@pytest.mark.parametrize("mode", ["dynamic", "mark_dynamic"])
def test_one_compilation_for_several_token_counts(mode, seed):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(loss_fn, backend=counter, fullgraph=True, dynamic=True if mode == "dynamic" else None)
    frames = []
    for layer in _layers([9, 17, 33, 64], seed):
        _assert_same(fn, layer, mark_dynamic=mode == "mark_dynamic")
        frames.append(counter.frame_count)
    # Later token counts reuse the first compilation.
    assert frames == frames[:1] * len(frames)
    real_graphs = [g for g in counter.graphs if any(n.op == "call_function" for n in g.graph.nodes)]
    assert len(real_graphs) == 1


@pytest.mark.slow
def test_inductor_forward_backward(seed):
    torch._dynamo.reset()
    fn = torch.compile(loss_fn, backend="inductor", fullgraph=True, dynamic=True)
    for layer in _layers([10, 21], seed):
        _assert_same(fn, layer)


def test_recompute_mode_compiles(seed):
    torch._dynamo.reset()
    layer = _layers([12], seed)[0]

    def recompute_loss(x, topk_ids, topk_weights, w_gate_up, w_down):
        out = moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, "swiglu", recompute=True)
        return (out.float() * out.float()).mean()

    _assert_same(torch.compile(recompute_loss, backend="aot_eager", fullgraph=True), layer)


def test_gradients_accumulate_under_compiled_autograd(seed):
    """The compiled backward returns every gradient at its end, so a weight's new gradient
    waits beside its ``.grad`` while the others are made (docs/performance.md); compiled
    autograd traces the accumulation into the backward graph instead. The ops run under it:
    two accumulated steps, the second with the backward under compiled autograd, give what
    eager's two give."""
    torch._dynamo.reset()
    layer = _layers([12], seed)[0]
    args = {k: (v.detach().clone().requires_grad_(True) if k in GRAD_ARGS else v) for k, v in layer.items()
            if k in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")}
    eager = {k: v.detach().clone().requires_grad_(True) if k in GRAD_ARGS else v for k, v in args.items()}
    for _ in range(2):
        loss_fn(**eager).backward()
    fn = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    fn(**args).backward()
    counters = torch._dynamo.utils.counters["compiled_autograd"]
    captures = counters["captures"]
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
        fn(**args).backward()
    assert counters["captures"] == captures + 1, "the backward did not run under compiled autograd"
    for k in GRAD_ARGS:
        assert rel_err(args[k].grad, eager[k].grad) < 1e-6, k


@pytest.mark.parametrize("recompute", [False, True])
def test_frozen_experts_compile(recompute, seed):
    """Frozen expert weights under torch.compile: the backward ops are traced with their
    weight gradients switched off, and the input and router gradients match eager."""
    layer = make_layer(12, 16, 8, 4, 2, seed=seed)

    def loss(x, topk_weights):
        out = moe_experts(x, layer["topk_ids"], topk_weights, layer["w_gate_up"], layer["w_down"], "swiglu",
                          recompute=recompute)
        return (out.float() * out.float()).mean()

    def grads(fn):
        x, tw = (layer[k].detach().clone().requires_grad_(True) for k in ("x", "topk_weights"))
        fn(x, tw).backward()
        return x.grad, tw.grad

    torch._dynamo.reset()
    for g, rg in zip(grads(torch.compile(loss, backend="aot_eager", fullgraph=True)), grads(loss)):
        assert rel_err(g, rg) < 1e-6


@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
def test_one_analysis_with_default_floats(activation, seed):
    """Compiling moe_experts itself: with alpha and limit left at their defaults no float
    becomes a symbol, so Dynamo analyses the frame once (a float symbol it cannot keep
    restarts the analysis, leaving an empty graph), across token counts too."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(moe_experts, backend=counter, fullgraph=True, dynamic=True)
    for L in (12, 20):
        layer = make_layer(L, 16, 8, 4, 2, seed=seed + L, activation=activation)
        assert rel_err(fn(**layer), moe_experts(**layer)) < 1e-6
    assert counter.frame_count == 1
    assert all(any(n.op == "call_function" for n in g.graph.nodes) for g in counter.graphs)


def test_floats_an_activation_ignores_compile_nothing(seed):
    """swiglu ignores alpha and limit: a new value passed for them compiles nothing."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    layer = make_layer(12, 16, 8, 4, 2, seed=seed)
    fn = torch.compile(moe_experts, backend=counter, fullgraph=True, dynamic=True)
    fn(**layer, alpha=1.702, limit=7.0)
    frames = counter.frame_count
    assert rel_err(fn(**layer, alpha=1.5, limit=6.0), moe_experts(**layer)) < 1e-6
    assert counter.frame_count == frames


@pytest.mark.parametrize("grad,recompute", [(True, False), (True, True), (False, False)],
                         ids=["default", "recompute", "no_grad"])
def test_traced_code_reads_no_settings(grad, recompute, seed, monkeypatch):
    """Dynamo never traces ``settings.current()``: the settings are read where kernels and
    lowerings run. (A traced read makes Dynamo guard on a ``KernelSettings``, which torch
    2.11 refuses with an assertion; 2.13 lets it pass.) Inside a traced frame
    ``torch.compiler.is_compiling()`` is true, so the patched reader fails the compile."""
    from moeblaze_ops import settings

    read = settings.current

    def current():
        if torch.compiler.is_compiling():
            raise AssertionError("settings.current() traced by Dynamo")
        return read()

    monkeypatch.setattr(settings, "current", current)
    torch._dynamo.reset()
    layer = make_layer(12, 16, 8, 4, 2, seed=seed, requires_grad=grad)
    fn = torch.compile(lambda kw: moe_experts(**kw, recompute=recompute), backend="aot_eager", fullgraph=True)
    out = fn(layer)
    if grad:
        out.sum().backward()
    assert rel_err(out, moe_experts(**layer)) < 1e-6


def test_hf_model_compiles_in_one_analysis(seed):
    """A tiny HF MoE with the moeblaze backend under torch.compile(fullgraph=True): one
    analysis (the backend hands moe_experts no float for gates that ignore alpha/limit)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import moeblaze_ops.hf

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moeblaze_ops.hf.model_config("qwen3_moe", num_layers=1),
                                             experts_implementation="moeblaze")
    ids = torch.randint(0, 256, (2, 8))
    eager = model(ids).logits  # transformers installs its output hooks on the first call
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)(ids).logits
    assert counter.frame_count == 1
    assert rel_err(compiled, eager) < 1e-5


@pytest.mark.parametrize("strict", [False, True])
def test_export_keeps_the_ops(strict, seed):
    """torch.export (strict: through Dynamo; non-strict: through a dispatch mode) records
    the moeblaze ops, and the exported program computes what eager does."""
    layer = make_layer(16, 8, 4, 4, 2, seed=seed)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_gate_up = torch.nn.Parameter(layer["w_gate_up"])
            self.w_down = torch.nn.Parameter(layer["w_down"])

        def forward(self, x, topk_ids, topk_weights):
            return moe_experts(x, topk_ids, topk_weights, self.w_gate_up, self.w_down)

    module, args = Experts(), (layer["x"], layer["topk_ids"], layer["topk_weights"])
    program = torch.export.export(module, args, strict=strict)
    ops = [str(n.target) for n in program.graph.nodes if str(n.target).startswith("moeblaze.")]
    assert ops == ["moeblaze.dispatch.default", "moeblaze.expert_up.default", "moeblaze.expert_down.default"]
    fresh = make_layer(16, 8, 4, 4, 2, seed=seed + 1)
    args = (fresh["x"], fresh["topk_ids"], fresh["topk_weights"])
    assert torch.equal(program.module()(*args), module(*args))


def test_compile_caches_key_on_the_settings(seed):
    """A graph compiled under some kernel settings is not reused under others (the lowerings
    read them after Inductor's FX graph cache has looked the graph up), and is reused under
    the same ones; the user's own cache tag stays in front."""
    import uuid

    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from moeblaze_ops import settings

    layer = make_layer(16, 8, 8, 4, 2, seed=seed)

    def compile_once():
        torch._dynamo.reset()
        torch.compile(moe_experts, fullgraph=True)(**layer)

    def hits():
        return counters["inductor"]["fxgraph_cache_hit"]

    mine = f"mine-{uuid.uuid4().hex}"  # keys no earlier run has cached
    with inductor_config.patch(fx_graph_cache=True), torch.compiler.config.patch(cache_key_tag=mine):
        settings._tag_compile_caches()  # as on Inductor's import, after the user's tag was set
        defaults_tag = torch.compiler.config.cache_key_tag
        assert defaults_tag.startswith(mine + " moeblaze:") and len(defaults_tag) > len(mine + " moeblaze:")
        compile_once()  # the defaults' graph, cached
        before = hits()
        with settings.override(column_slab=5):
            assert torch.compiler.config.cache_key_tag.startswith(mine + " moeblaze:")
            assert torch.compiler.config.cache_key_tag != defaults_tag
            compile_once()
            assert hits() == before, "a graph compiled under other settings was reused"
        with settings.override(column_slab=5):
            compile_once()
            assert hits() == before + 1, "the graph compiled under these settings was not reused"
        assert torch.compiler.config.cache_key_tag == defaults_tag


def test_compile_caches_key_on_the_package_code(seed, monkeypatch):
    """A graph compiled by one version of the package's code (the lowerings decide which
    op or template a graph calls) is not reused by another, and is reused by the same."""
    import uuid

    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from moeblaze_ops import settings

    layer = make_layer(16, 8, 8, 4, 2, seed=seed)

    def compile_under(code):
        monkeypatch.setattr(settings, "_code_digest", lambda: code)
        settings._tag_compile_caches()
        torch._dynamo.reset()
        torch.compile(moe_experts, fullgraph=True)(**layer)
        return counters["inductor"]["fxgraph_cache_hit"]

    with inductor_config.patch(fx_graph_cache=True), \
            torch.compiler.config.patch(cache_key_tag=f"mine-{uuid.uuid4().hex}"):
        before = compile_under("one version")
        assert compile_under("another version") == before, "a graph compiled by other code was reused"
        assert compile_under("one version") == before + 1, "the graph compiled by the same code was not reused"
