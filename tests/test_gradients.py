"""gradcheck in float64, and parity of outputs and every gradient with the reference."""

import contextlib

import pytest
import torch

from moeblaze_ops import ACTIVATIONS, is_gated, moe_experts
from moeblaze_ops.testing import LAYOUTS, make_layer, reference_moe, rel_err

GRAD_ARGS = ("x", "topk_weights", "w_gate_up", "w_down", "b_gate_up", "b_down")

# Every (activation, layout) pair that differs: ``interleaved`` orders the gate and up
# columns, so activations without a gate run the same with and without it.
ACTIVATION_LAYOUTS = [pytest.param(activation, layout, id=f"{activation}-{layout}")
                      for activation in ACTIVATIONS for layout, (_, interleaved) in LAYOUTS.items()
                      if is_gated(activation) or not interleaved]


def _grad_inputs(layer):
    return [k for k in GRAD_ARGS if layer[k] is not None]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation,layout", ACTIVATION_LAYOUTS)
def test_gradcheck(activation, layout, bias, seed):
    layer = make_layer(5, 4, 3, 3, 2, dtype=torch.float64, activation=activation, layout=layout,
                       bias=bias, seed=seed, requires_grad=True)
    names = _grad_inputs(layer)

    def f(*tensors):  # gradcheck backpropagates through one graph many times: h must survive
        return moe_experts(**{**layer, **dict(zip(names, tensors))}, limit=1.0, overwrite_h=False)

    assert torch.autograd.gradcheck(f, [layer[k] for k in names]), f"seed={seed}"


@pytest.mark.parametrize("frozen", [(), ("w_gate_up", "b_gate_up", "x"), ("w_down", "b_down", "topk_weights")],
                         ids=["all", "up_frozen", "down_frozen"])
@pytest.mark.parametrize("activation,layout", [("swiglu", "concatenated"), ("clamped_swiglu", "transposed_interleaved"),
                                               ("gelu", "transposed")])
def test_expert_layer_gradients(activation, layout, frozen, seed):
    """``moeblaze::expert_layer``'s autograd formula (h recomputed; ``moe_experts`` calls the
    op only where nothing is differentiated, so only a direct call reaches it): gradcheck
    in float64 on sentinels and an empty expert, inputs in ``frozen`` left out."""
    layer = make_layer(7, 4, 3, 4, 2, dtype=torch.float64, activation=activation, layout=layout, bias=True,
                       routing="no_last", sentinel_frac=0.3, seed=seed)
    ops = torch.ops.moeblaze
    eti, offsets, tim = ops.dispatch(layer["topk_ids"], 4)
    names = [k for k in _grad_inputs(layer) if k not in frozen]

    def f(*tensors):
        t = {**layer, **dict(zip(names, tensors))}
        return ops.expert_layer(t["x"], t["w_gate_up"], t["w_down"], eti, offsets, tim, t["topk_weights"],
                                t["b_gate_up"], t["b_down"], activation, layer["transposed"], layer["interleaved"],
                                1.702, 1.0)

    inputs = [layer[k].detach().clone().requires_grad_(True) for k in names]
    assert torch.autograd.gradcheck(f, inputs), f"seed={seed}"


def test_gradcheck_sentinels_and_empty_expert(seed):
    layer = make_layer(7, 4, 3, 4, 2, dtype=torch.float64, routing="no_last", sentinel_frac=0.3, bias=True,
                       seed=seed, requires_grad=True)
    names = _grad_inputs(layer)
    f = lambda *t: moe_experts(**{**layer, **dict(zip(names, t))}, overwrite_h=False)  # noqa: E731
    assert torch.autograd.gradcheck(f, [layer[k] for k in names]), f"seed={seed}"


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def _parity(layer, seed, tol, **kw):
    out = moe_experts(**layer, **kw)
    names = _grad_inputs(layer)
    grad_out = torch.randn_like(out, dtype=torch.float64)
    grads = torch.autograd.grad(out, [layer[k] for k in names], grad_out.to(out.dtype))

    ref_layer = {k: (v.detach().double().requires_grad_(True) if torch.is_tensor(v) and v.is_floating_point()
                     else v) for k, v in layer.items()}
    ref = reference_moe(**ref_layer, **kw)
    ref_grads = torch.autograd.grad(ref, [ref_layer[k] for k in names], grad_out)

    assert out.dtype == layer["x"].dtype and out.shape == layer["x"].shape
    assert rel_err(out, ref) <= tol, f"out: {rel_err(out, ref)} seed={seed}"
    for name, g, rg in zip(names, grads, ref_grads):
        assert g.dtype == layer[name].dtype and g.shape == layer[name].shape
        assert rel_err(g, rg) <= tol, f"grad {name}: {rel_err(g, rg)} seed={seed}"


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("activation,layout", ACTIVATION_LAYOUTS)
def test_parity_with_reference(dtype, activation, layout, seed):
    """Output and every gradient vs the float64 reference, in each weight layout (biases
    with the transposed ones: GPT-OSS's transposed, interleaved experts have them)."""
    layer = make_layer(64, 32, 24, 8, 2, dtype=dtype, activation=activation, layout=layout,
                       bias=LAYOUTS[layout][0], seed=seed, requires_grad=True)
    # A clamp limit inside the range of h exercises the clamps; in half precision h is rounded
    # to the storage dtype, so values near the limit may fall on the other side of the clamp
    # than in the float64 reference: the low-precision runs keep the limit out of range.
    _parity(layer, seed, TOL[dtype], limit=1.5 if dtype in (torch.float32, torch.float64) else 7.0)


def _to_layout(layer, layout):
    """``layer`` (concatenated, gated) with its weights rearranged into ``layout``: the same
    layer, stored differently."""
    transposed, interleaved = LAYOUTS[layout]

    def interleave(w, dim):  # [gate | up] halves -> gate and up columns alternating
        gate, up = w.chunk(2, dim=dim)
        return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)

    w_gate_up, b_gate_up = layer["w_gate_up"], layer["b_gate_up"]
    if interleaved:
        w_gate_up, b_gate_up = interleave(w_gate_up, 1), interleave(b_gate_up, 1)
    w_down = layer["w_down"]
    if transposed:
        w_gate_up, w_down = w_gate_up.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous()
    return {**layer, "w_gate_up": w_gate_up, "b_gate_up": b_gate_up, "w_down": w_down,
            "transposed": transposed, "interleaved": interleaved}


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "concatenated"])
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
def test_layouts_store_the_same_layer(activation, layout, seed):
    """``transposed`` and ``interleaved`` change only how the weights are stored: the same
    weights rearranged into each layout give the concatenated layout's output and
    gradients (rearranged back), whatever the other flag."""
    base = make_layer(24, 8, 6, 4, 2, dtype=torch.float64, activation=activation, bias=True, seed=seed)
    names = _grad_inputs(base)

    def run(layer):
        inputs = {k: (v.clone().requires_grad_(True) if k in names else v) for k, v in layer.items()}
        out = moe_experts(**inputs, limit=1.0)
        return out, dict(zip(names, torch.autograd.grad(out, [inputs[k] for k in names], torch.ones_like(out))))

    want, want_grads = run(base)
    got, got_grads = run(_to_layout(base, layout))
    built = make_layer(2, 8, 6, 4, 2, activation=activation, layout=layout)  # make_layer's own layout
    assert built["w_gate_up"].shape == got_grads["w_gate_up"].shape
    assert built["w_down"].shape == got_grads["w_down"].shape
    assert rel_err(got, want) <= 1e-12, f"seed={seed}"
    # The gradient of a rearranged weight is the rearranged gradient.
    rearranged = _to_layout({**base, **want_grads}, layout)
    for name in names:
        assert rel_err(got_grads[name], rearranged[name]) <= 1e-12, f"grad {name} seed={seed}"


@pytest.mark.parametrize(
    "L,K,E,routing,sentinel_frac",
    [
        (48, 2, 8, "skewed", 0.0),
        (40, 1, 4, "first", 0.0),
        (40, 3, 6, "no_last", 0.0),
        (40, 2, 6, "uniform", 0.25),
        (1, 4, 8, "uniform", 0.0),
        (20, 1, 1, "uniform", 0.0),
        (64, 8, 64, "uniform", 0.0),
    ],
)
def test_parity_routings(L, K, E, routing, sentinel_frac, seed):
    layer = make_layer(L, 16, 8, E, K, dtype=torch.float32, routing=routing, sentinel_frac=sentinel_frac,
                       bias=True, seed=seed, requires_grad=True)
    _parity(layer, seed, TOL[torch.float32])


def test_fp32_weights_with_bf16_activations(seed):
    layer = make_layer(32, 16, 8, 4, 2, dtype=torch.bfloat16, tw_dtype=torch.float32, seed=seed,
                       requires_grad=True)
    _parity(layer, seed, TOL[torch.bfloat16])


def test_leading_dimensions(seed):
    layer = make_layer(12, 8, 4, 4, 2, seed=seed)
    flat = moe_experts(**layer)
    shaped = moe_experts(**{**layer, "x": layer["x"].view(3, 4, 8), "topk_ids": layer["topk_ids"].view(3, 4, 2),
                            "topk_weights": layer["topk_weights"].view(3, 4, 2)})
    assert shaped.shape == (3, 4, 8)
    assert torch.equal(shaped.reshape(12, 8), flat)


def test_deterministic(seed):
    layer = make_layer(64, 16, 8, 4, 3, routing="skewed", seed=seed, requires_grad=True)
    runs = []
    for _ in range(2):
        out = moe_experts(**layer)
        grads = torch.autograd.grad(out.square().sum(), [layer[k] for k in _grad_inputs(layer)])
        runs.append((out, *grads))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# Which backward GEMMs run, for each set of trainable inputs: the need_* flags of
# expert_up_backward (None: not called) and of the down op.
FROZEN_CASES = {
    "frozen_experts": (("x", "topk_weights"), dict(need_input_grad=True, need_weight_grad=False),
                       dict(need_weight_grad=False)),
    "frozen_input": (("w_gate_up", "w_down", "b_gate_up", "b_down", "topk_weights"),
                     dict(need_input_grad=False, need_weight_grad=True), dict(need_weight_grad=True)),
    "only_down": (("w_down",), None, dict(need_weight_grad=True)),
}


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("case", list(FROZEN_CASES))
def test_frozen_inputs_skip_their_gradients(case, recompute, seed):
    from kernel_cases import check_frozen_grads

    trainable, up_flags, down_flags = FROZEN_CASES[case]
    calls = dict(check_frozen_grads(9, 8, 4, 3, 2, trainable=trainable, dtype=torch.float32, device="cpu",
                                    seed=seed, recompute=recompute))
    assert calls.get("expert_up_backward") == up_flags
    assert calls["expert_down_backward_recompute" if recompute else "expert_down_backward_"] == down_flags


@pytest.mark.parametrize("bias", [False, True])
def test_overwrite_h(bias, seed):
    """Eager backward writes dH over the kept h (overwrite_h, the default): the same
    gradients, bit for bit, as keeping the two apart, in a first and in a second backward
    through the graph (which recomputes the overwritten h)."""
    layer = make_layer(33, 8, 4, 3, 2, dtype=torch.float32, routing="skewed", bias=bias, seed=seed)
    names = _grad_inputs(layer)
    g = torch.randn(33, 8, generator=torch.Generator().manual_seed(seed))
    grads = {}
    for overwrite in (True, False):
        inputs = {k: (v.clone().requires_grad_(k in names) if k in names else v) for k, v in layer.items()}
        out = moe_experts(**inputs, overwrite_h=overwrite)
        grads[overwrite] = torch.autograd.grad(out, [inputs[k] for k in names], g, retain_graph=True)
        again = torch.autograd.grad(out, [inputs[k] for k in names], g)
        assert all(torch.equal(a, b) for a, b in zip(again, grads[overwrite])), f"overwrite_h={overwrite}"
    for name, a, b in zip(names, grads[True], grads[False]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_overwrite_h_under_activation_checkpointing(use_reentrant, seed):
    """torch.utils.checkpoint (HF's gradient checkpointing) recomputes the layer in
    backward; the overwritten h is then the recomputed one: gradients as without it."""
    from torch.utils.checkpoint import checkpoint

    layer = make_layer(33, 8, 4, 3, 2, dtype=torch.float32, bias=True, seed=seed)
    names = _grad_inputs(layer)
    grads = []
    for ckpt in (False, True):
        inputs = [layer[k].clone().requires_grad_(True) for k in names]
        f = lambda *t: moe_experts(**{**layer, **dict(zip(names, t))})  # noqa: E731
        out = checkpoint(f, *inputs, use_reentrant=use_reentrant) if ckpt else f(*inputs)
        out.square().sum().backward()
        grads.append([t.grad for t in inputs])
    for name, a, b in zip(names, *grads):
        assert torch.equal(a, b), name


class _SeesOps(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that only records the moeblaze ops it sees: with it active,
    ``moe_experts`` must route through the ops."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket).startswith("moeblaze."):
            self.ops.add(str(func.overloadpacket).split(".")[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", [{}, {"overwrite_h": False}, {"recompute": True}],
                         ids=["default", "kept_apart", "recompute"])
def test_plain_and_moded_calls_agree(mode, seed):
    """A dispatch mode (as a subclass would) sees every op of the layer, forward and
    backward; outputs and every gradient agree bit for bit with plain tensors', in a
    first and a second backward through the graph (the second recomputes the h the first
    overwrote)."""
    layer = make_layer(41, 8, 4, 5, 3, dtype=torch.float32, routing="skewed", bias=True, seed=seed,
                       activation="clamped_swiglu", layout="transposed_interleaved", tw_dtype=torch.float32)
    names = _grad_inputs(layer)
    g = torch.randn(41, 8, generator=torch.Generator().manual_seed(seed + 1))
    runs = []
    for seen in (None, _SeesOps()):
        inputs = {k: (v.clone().requires_grad_(True) if k in names else v) for k, v in layer.items()}
        with seen or contextlib.nullcontext():
            out = moe_experts(**inputs, **mode)
            first = torch.autograd.grad(out, [inputs[k] for k in names], g, retain_graph=True)
            second = torch.autograd.grad(out, [inputs[k] for k in names], g)
        runs.append((out, *first, *second))
        if seen is not None:
            # recompute's forward needs no h: the gated layer runs as expert_layer
            forward = {"expert_layer"} if mode.get("recompute") else {"expert_up", "expert_down"}
            backward = ("expert_down_backward_recompute" if mode.get("recompute") else
                        "expert_down_backward" if mode.get("overwrite_h") is False else "expert_down_backward_")
            assert {"dispatch", *forward, backward, "expert_up_backward"} <= seen.ops, seen.ops
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_profiles_show_the_ops(seed):
    """A profiler trace of the layer names its steps after the ops."""
    layer = make_layer(9, 8, 4, 3, 2, dtype=torch.float32, seed=seed, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        moe_experts(**layer).sum().backward()
    names = {e.key for e in prof.key_averages()}
    expected = {"moeblaze::dispatch", "moeblaze::expert_up", "moeblaze::expert_down",
                "moeblaze::expert_down_backward_", "moeblaze::expert_up_backward"}
    assert expected <= names, expected - names


@pytest.mark.parametrize("kind", ["meta", "fake"])
def test_meta_and_fake_tensors_take_the_op_route(kind, seed):
    """Meta tensors, and fake ones under FakeTensorMode, run the ops' fake functions (the
    kernel route would try to launch kernels on them): forward and backward give the
    shapes of a real run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = make_layer(16, 8, 4, 4, 2, seed=seed, requires_grad=True)
    mode = FakeTensorMode() if kind == "fake" else contextlib.nullcontext()
    with mode:
        inputs = {k: ((mode.from_tensor(v) if kind == "fake" else v.detach().to("meta")).requires_grad_(v.requires_grad)
                      if torch.is_tensor(v) else v) for k, v in layer.items()}
        out = moe_experts(**inputs)
        out.sum().backward()
    assert out.shape == layer["x"].shape and out.device.type == ("meta" if kind == "meta" else "cpu")
    for k in _grad_inputs(layer):
        assert inputs[k].grad is not None and inputs[k].grad.shape == layer[k].shape, k


def _spy_on_torch_backend(monkeypatch, **labels):
    """Wraps the portable backend's functions named in ``labels`` (field name -> label) so
    that each call appends its label to the returned list."""
    import dataclasses

    from moeblaze_ops import kernels

    seen = []

    def spied(name, fn):
        def call(*args, **kwargs):
            seen.append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(kernels, "TORCH", dataclasses.replace(
        kernels.TORCH, **{field: spied(label, getattr(kernels.TORCH, field)) for field, label in labels.items()}))
    return seen


def _step(layer, grad_out, seen):
    """One forward + backward of ``layer``: ``((output, *gradients), the labels added to
    seen meanwhile)``."""
    names = _grad_inputs(layer)
    inputs = {k: (v.clone().requires_grad_(True) if k in names else v) for k, v in layer.items()}
    seen.clear()
    out = moe_experts(**inputs)
    grads = torch.autograd.grad(out, [inputs[k] for k in names], grad_out)
    return (out, *grads), list(seen)


def _beside_rule(monkeypatch, max_columns, min_rows):
    """Moves the edges of ``config.activation_beside_h`` to put a small layer on either side."""
    from moeblaze_ops.kernels import config

    monkeypatch.setattr(config, "ACTIVATION_BESIDE_H_MAX_COLUMNS", max_columns)
    monkeypatch.setattr(config, "ACTIVATION_BESIDE_H_MIN_ROWS", min_rows)


@pytest.mark.parametrize("activation,layout", [("swiglu", "concatenated"), ("clamped_swiglu", "transposed_interleaved"),
                                               ("silu", "concatenated")])
def test_layer_without_gradients_makes_no_h(activation, layout, seed, monkeypatch):
    """With nothing to differentiate, a layer (gated or not) runs as ``expert_layer``:
    act(h) from the up projection (no h), handed to the down projection, which activates
    nothing itself; the output is the one the training route gives. Every layer with
    gradients makes h and activates it in the down projection."""
    seen = _spy_on_torch_backend(monkeypatch, expert_up="up", expert_up_with_activation="up_beside",
                                 expert_up_activated="up_activated", expert_down="down",
                                 expert_down_activated="down_activated")
    layer = make_layer(41, 8, 4, 5, 3, dtype=torch.float32, routing="skewed", bias=True, seed=seed,
                       activation=activation, layout=layout)
    g = torch.randn(41, 8, generator=torch.Generator().manual_seed(seed + 1))
    (trained, *_), called = _step(layer, g, seen)
    assert called == ["up", "down"]
    with torch.no_grad(), _SeesOps() as mode:
        seen.clear()
        out = moe_experts(**layer)
    assert mode.ops == {"dispatch", "expert_layer"}
    assert seen == ["up_activated", "down_activated"]
    assert rel_err(out, trained.detach()) <= 1e-6


@pytest.mark.parametrize("activation,layout,bias", [("swiglu", "concatenated", False),
                                                    ("clamped_swiglu", "transposed", False),
                                                    ("clamped_swiglu", "transposed_interleaved", False),
                                                    ("swiglu", "concatenated", True), ("gelu", "concatenated", False)])
def test_activation_beside_h_route(activation, layout, bias, seed, monkeypatch):
    """``config.activation_beside_h``'s column bound at or above the layer's I and its row
    bound at or below its routed rows per expert: with gradients, a gated layer's up
    projection hands act(h) beside h to the down projection, which then runs no
    activation of its own (``expert_down_activated``); outputs and gradients as without
    it (float32, where act(h) rounds to nothing). Past either edge, with interleaved
    halves or biases (the rule's, for eager and compiled layers alike), and in non-gated
    layers: h alone and the down projection's activation."""
    seen = _spy_on_torch_backend(monkeypatch, expert_up_with_activation="up", expert_up="up", expert_down="down",
                                 expert_down_activated="down_activated")
    layer = make_layer(41, 8, 4, 5, 3, dtype=torch.float32, routing="skewed", bias=bias, seed=seed,
                       activation=activation, layout=layout)
    g = torch.randn(41, 8, generator=torch.Generator().manual_seed(seed + 1))
    runs = []
    # I is 4; 123 routed rows over 5 experts: 24.6 a expert
    for limit, min_rows in ((-1, 0), (3, 0), (4, 0), (4, 24), (4, 25)):
        _beside_rule(monkeypatch, limit, min_rows)
        run, called = _step(layer, g, seen)
        runs.append(run)
        beside = limit == 4 and min_rows <= 24 and is_gated(activation) and "interleaved" not in layout and not bias
        assert called == (["up", "down_activated"] if beside else ["up", "down"])
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert rel_err(b, a) <= 1e-6


def test_activation_beside_h_backward_makes_no_gradient_for_it(seed, monkeypatch):
    """act(h) beside h is not differentiable, and backward makes no gradient for it: no
    [L*K, I] buffer of zeros (autograd's materialized gradient of an unused output, as big
    as act(h) itself and alive in the up projection's backward, at its peak)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moeblaze_ops import moe_experts

    L, I, K = 41, 4, 3
    layer = make_layer(L, 8, I, 5, K, dtype=torch.float32, seed=seed, requires_grad=True)

    class Zeros(TorchDispatchMode):
        shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default,
                        torch.ops.aten.new_zeros.default):
                self.shapes.append(tuple(out.shape))
            return out

    _beside_rule(monkeypatch, I, 0)
    out = moe_experts(**layer)
    with Zeros():
        out.backward(torch.randn_like(out))
    assert (L * K, I) not in Zeros.shapes
    assert layer["x"].grad is not None and layer["w_gate_up"].grad is not None


@pytest.mark.parametrize("activation,layout", [("swiglu", "concatenated"), ("clamped_swiglu", "transposed_interleaved")])
def test_activation_beside_h_parity_with_reference(activation, layout, seed, monkeypatch):
    """The same route in bfloat16, where the down projection reads act(h) rounded to 16
    bits rather than computed from h in float32: output and every gradient still within
    the reference's tolerance."""
    layer = make_layer(64, 32, 24, 8, 2, dtype=torch.bfloat16, activation=activation, layout=layout,
                       bias=LAYOUTS[layout][0], seed=seed, requires_grad=True)
    _beside_rule(monkeypatch, 24, 0)
    _parity(layer, seed, TOL[torch.bfloat16], limit=7.0)
