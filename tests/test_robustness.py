"""What a new user hits first: second backwards, help(), errors under torch.compile, raw
ops fed arrays that are not a dispatch result, sentinels with non-finite weights, limits,
torch.func and double backward."""

import os
import pydoc
import traceback

import pytest
import torch

import moeblaze_ops
from moeblaze_ops import moe_experts, settings
from moeblaze_ops.testing import make_layer, reference_moe, rel_err

GRADS = ("x", "topk_weights", "w_gate_up", "w_down", "b_gate_up", "b_down")
OPS = ("dispatch", "expert_up", "expert_down", "expert_up_backward", "expert_down_backward",
       "expert_down_backward_", "expert_down_backward_recompute", "expert_layer")


def _grads(layer, out, grad_out, retain):
    names = [k for k in GRADS if layer[k] is not None]
    return torch.autograd.grad(out, [layer[k] for k in names], grad_out, retain_graph=retain)


# --------------------------------------------------------------------------- second backward


@pytest.mark.parametrize("mode", [{}, {"overwrite_h": False}, {"recompute": True}], ids=["default", "kept_apart",
                                                                                        "recompute"])
def test_second_backward_through_the_same_graph(mode, seed):
    """retain_graph: a second (and third) backward gives the first one's gradients bit for
    bit in every mode, also the default one that writes dH over the kept h."""
    layer = make_layer(30, 16, 8, 4, 2, seed=seed, bias=True, requires_grad=True, sentinel_frac=0.1)
    out = moe_experts(**layer, **mode)
    g = torch.randn_like(out)
    first = _grads(layer, out, g, retain=True)
    second = _grads(layer, out, g, retain=True)
    third = _grads(layer, out, g, retain=False)
    ref = _grads(layer, reference_moe(**{k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                                         for k, v in layer.items()}), g.double(), retain=False)
    for a, b, c, r in zip(first, second, third, ref):
        assert torch.equal(a, b) and torch.equal(a, c), f"seed={seed}"
        assert rel_err(a, r) < 1e-5, f"seed={seed}"


@pytest.mark.parametrize("backend", ["moeblaze", "moeblaze_recompute"])
def test_hf_backend_second_backward(backend, seed):
    """The HF backends under retain_graph=True: both backwards give eager's gradients."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import moeblaze_ops.hf

    torch.manual_seed(seed)
    cfg = moeblaze_ops.hf.model_config("qwen3_moe", num_layers=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    grads = {}
    for impl in ("eager", backend):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation=impl)
        loss = model(input_ids=ids, labels=ids).loss
        params = [p for p in model.parameters() if p.requires_grad]
        first = torch.autograd.grad(loss, params, retain_graph=True)
        second = torch.autograd.grad(loss, params)
        assert all(torch.equal(a, b) for a, b in zip(first, second)), impl
        grads[impl] = first
    for a, b in zip(grads["eager"], grads[backend]):
        assert rel_err(b, a) < 1e-4


# --------------------------------------------------------------------------- help()


@pytest.mark.parametrize("name", OPS)
def test_help_shows_the_ops_documentation(name):
    """help() of the package's op objects and of torch.ops.moeblaze.* shows the op's own
    schema and docstring, not the CustomOpDef/OpOverloadPacket class documentation."""
    packet = getattr(torch.ops.moeblaze, name)
    for obj in (packet, getattr(moeblaze_ops, name, None)):
        if obj is None:
            continue
        text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
        assert f"moeblaze::{name}(" in text
        first_doc_line = packet.__doc__.split("\n\n", 1)[1].splitlines()[0]
        assert len(first_doc_line) > 20 and first_doc_line in text
        assert "Methods defined here" not in text  # the class help


# --------------------------------------------------------------------------- errors under torch.compile


def _exception_lines(error):
    """The exception lines of a printed traceback, in the order a user reads them."""
    lines = "".join(traceback.format_exception(error)).splitlines()
    return [line for line in lines if line and not line.startswith((" ", "Traceback", "The above", "During"))]


@pytest.mark.slow
def test_compiled_front_door_error_shows_the_message_first(seed):
    """A bad input under torch.compile(fullgraph=True): the first exception a printed
    traceback shows carries moe_experts' own message (Dynamo chains it as the cause)."""
    layer = make_layer(8, 16, 8, 4, 2, seed=seed)
    bad = {**layer, "topk_weights": layer["topk_weights"][:, :1]}
    with pytest.raises(ValueError) as eager:
        moe_experts(**bad)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(moe_experts, fullgraph=True)(**bad)
    assert str(eager.value) in _exception_lines(compiled.value)[0]


@pytest.mark.slow
def test_compiled_raw_op_error_carries_the_message():
    """A raw op's bad argument under torch.compile: torch 2.13's Dynamo reports fake-function
    errors as TorchRuntimeError, with the op's own message in its explanation."""
    ids = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError) as eager:
        torch.ops.moeblaze.dispatch(ids, 0)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(lambda t: torch.ops.moeblaze.dispatch(t, 0), fullgraph=True)(ids)
    assert str(eager.value) in str(compiled.value)


# --------------------------------------------------------------------------- raw ops and their index arrays


def _raw_args(seed, L=10, K=2, E=4):
    layer = make_layer(L, 8, 4, E, K, seed=seed)
    eti, offsets, tim = moeblaze_ops.dispatch(layer["topk_ids"], E)
    h = torch.ops.moeblaze.expert_up(layer["x"], layer["w_gate_up"], eti, offsets, tim)
    return layer, h, eti, offsets, tim


def test_topk_weights_transposed_is_refused(seed):
    layer, h, eti, offsets, tim = _raw_args(seed)
    with pytest.raises(ValueError, match="expert_token_indices.*token ids in \\[0, L = 2\\)"):
        torch.ops.moeblaze.expert_down(h, layer["w_down"], eti, offsets, tim, layer["topk_weights"].t().contiguous())


@pytest.mark.parametrize("defect,arg", [("decreasing_offsets", "expert_offsets"),
                                        ("offsets_past_rows", "expert_offsets"),
                                        ("token_out_of_range", "expert_token_indices"),
                                        ("negative_token", "expert_token_indices"),
                                        ("map_not_a_permutation", "token_index_map"),
                                        ("map_out_of_range", "token_index_map")])
@pytest.mark.parametrize("op", ["expert_up", "expert_down", "expert_down_backward"])
def test_index_arrays_that_are_not_a_dispatch_result(defect, arg, op, seed):
    """On the portable backend each op names the array whose values are wrong (instead of
    an IndexError or a silently wrong result)."""
    layer, h, eti, offsets, tim = _raw_args(seed)
    eti, offsets, tim = eti.clone(), offsets.clone(), tim.clone()
    if defect == "decreasing_offsets":
        offsets[2], offsets[3] = offsets[3], offsets[2] - 1
    elif defect == "offsets_past_rows":
        offsets[-1] = tim.numel() + 1
    elif defect == "token_out_of_range":
        eti[3] = layer["x"].shape[0]
    elif defect == "negative_token":
        eti[0] = -1
    elif defect == "map_not_a_permutation":
        tim[1] = tim[0]
    else:
        tim[0] = tim.numel()
    call = {
        "expert_up": lambda: torch.ops.moeblaze.expert_up(layer["x"], layer["w_gate_up"], eti, offsets, tim),
        "expert_down": lambda: torch.ops.moeblaze.expert_down(h, layer["w_down"], eti, offsets, tim,
                                                              layer["topk_weights"]),
        "expert_down_backward": lambda: torch.ops.moeblaze.expert_down_backward(
            torch.randn_like(layer["x"]), h, layer["w_down"], eti, offsets, tim, layer["topk_weights"], None,
            "swiglu", False, False, 1.702, 7.0),
    }[op]
    with pytest.raises(ValueError, match=f"moeblaze.{op}: argument '{arg}'"):
        call()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("defect", ["decreasing_offsets", "token_out_of_range", "map_out_of_range", "none"])
def test_index_arrays_checked_by_the_triton_backend(defect, seed):
    """The Triton backend's device-side check (run here by the interpreter, where the
    assert raises at once): wrong arrays fail with the op's message, right ones pass."""
    layer, h, eti, offsets, tim = _raw_args(seed)
    eti, offsets, tim = eti.clone(), offsets.clone(), tim.clone()
    if defect == "decreasing_offsets":
        offsets[2], offsets[3] = offsets[3], offsets[2] - 1
    elif defect == "token_out_of_range":
        eti[-1] = layer["x"].shape[0]
    elif defect == "map_out_of_range":
        tim[-1] = -1
    with settings.override(backend="triton"):
        run = lambda: torch.ops.moeblaze.expert_down(h, layer["w_down"], eti, offsets, tim,  # noqa: E731
                                                     layer["topk_weights"])
        if defect == "none":
            assert rel_err(run(), reference_moe(**{k: (v.double() if torch.is_tensor(v) and v.is_floating_point()
                                                       else v) for k, v in layer.items()})) < 1e-5
        else:
            with pytest.raises(RuntimeError, match="moeblaze.expert_down: index arrays not from dispatch"):
                run()


@pytest.mark.parametrize("op", OPS)
def test_device_check_messages_fit_a_cuda_assert(op):
    """CUDA's torch._assert_async refuses messages of 255 characters or more."""
    from moeblaze_ops.checks import id_value_messages, id_values_message, index_values_message

    assert all(len(m) < 255 for m in (index_values_message(op), id_values_message(op), *id_value_messages(op)))


# --------------------------------------------------------------------------- sentinels


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("poison", [float("inf"), float("nan"), -float("inf")])
def test_sentinel_weights_contribute_nothing(backend, poison, seed):
    """A sentinel slot (id >= E) adds nothing to the output or any gradient whatever its
    router weight, inf and NaN included: the same bits as with weight 0 there, and a zero
    router gradient there."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    layer = make_layer(24, 16, 8, 4, 2, seed=seed, bias=True, sentinel_frac=0.3)
    sentinel = layer["topk_ids"] >= 4
    assert sentinel.any() and not sentinel.all()
    results = []
    for fill in (0.0, poison):
        inputs = {k: (v.detach().clone().requires_grad_(k in GRADS) if torch.is_tensor(v) and v.is_floating_point()
                      else v) for k, v in layer.items()}
        with torch.no_grad():
            inputs["topk_weights"][sentinel] = fill
        with settings.override(backend=backend):
            out = moe_experts(**inputs)
            grads = _grads(inputs, out, torch.ones_like(out), retain=False)
        results.append((out, grads))
    (out0, grads0), (out1, grads1) = results
    assert torch.isfinite(out1).all() and torch.equal(out0, out1)
    for name, a, b in zip(GRADS, grads0, grads1):
        assert torch.isfinite(b).all() and torch.equal(a, b), name
    assert (grads1[1][sentinel] == 0).all()


# --------------------------------------------------------------------------- limits and blame


def test_routed_rows_beyond_int32_are_refused():
    ids = torch.empty(2**29, 8, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="moeblaze.dispatch: argument 'topk_ids' routes 4294967296"):
        torch.ops.moeblaze.dispatch(ids, 8)


def test_too_many_experts_is_refused_before_allocating():
    with pytest.raises(ValueError, match="'num_experts' must be at most 65536, got 1000000000"):
        torch.ops.moeblaze.dispatch(torch.zeros(4, 2, dtype=torch.int64), 10**9)


def test_no_experts_blames_the_weights(seed):
    layer = make_layer(8, 16, 8, 4, 2, seed=seed)
    with pytest.raises(ValueError, match="moeblaze.moe_experts: argument 'w_gate_up' must hold between 1"):
        moe_experts(**{**layer, "w_gate_up": layer["w_gate_up"][:0], "w_down": layer["w_down"][:0]})


@pytest.mark.parametrize("odd_one", ["x", "topk_ids", "topk_weights", "w_down"])
def test_a_tensor_on_another_device_is_the_one_named(odd_one, seed):
    layer = make_layer(8, 16, 8, 4, 2, seed=seed)
    layer[odd_one] = layer[odd_one].to("meta")
    with pytest.raises(ValueError, match=f"argument '{odd_one}' must be on device cpu, got meta"):
        moe_experts(**layer)


# --------------------------------------------------------------------------- torch.func, double backward


def test_torch_func_transforms_are_refused_clearly(seed):
    layer = make_layer(8, 16, 8, 4, 2, seed=seed)
    message = "does not support torch.func transforms"
    with pytest.raises(NotImplementedError, match=message):
        torch.func.grad(lambda x: moe_experts(**{**layer, "x": x}).sum())(layer["x"])
    with pytest.raises(NotImplementedError, match=message):
        torch.vmap(lambda x: moe_experts(**{**layer, "x": x}))(layer["x"][None].expand(2, -1, -1))


@pytest.mark.parametrize("mode", [{}, {"overwrite_h": False}, {"recompute": True}])
def test_double_backward_is_refused_clearly(mode, seed):
    layer = make_layer(8, 16, 8, 4, 2, seed=seed, dtype=torch.float64, requires_grad=True)
    out = moe_experts(**layer, **mode)
    (grad_x,) = torch.autograd.grad(out.square().sum(), layer["x"], create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        grad_x.sum().backward()


@pytest.mark.parametrize("op", ["expert_up_backward", "expert_down_backward", "expert_down_backward_"])
def test_backward_ops_refuse_their_own_differentiation(op, seed):
    """A backward op called directly on tensors that require grad: differentiating its
    outputs raises, rather than returning a gradient no formula computed."""
    layer = make_layer(8, 16, 8, 4, 2, seed=seed, dtype=torch.float64)
    ops = torch.ops.moeblaze
    eti, offsets, tim = ops.dispatch(layer["topk_ids"], 4)
    x, w_gate_up, w_down = layer["x"], layer["w_gate_up"], layer["w_down"]
    h = ops.expert_up(x, w_gate_up, eti, offsets, tim)
    if op == "expert_up_backward":
        grad = torch.randn_like(h).requires_grad_(True)
        outputs = ops.expert_up_backward(grad, x, w_gate_up, eti, offsets, tim, False, False)
    else:
        grad = torch.randn_like(x).requires_grad_(True)
        outputs = getattr(ops, op)(grad, h.contiguous(), w_down, eti, offsets, tim, layer["topk_weights"], None,
                                   "swiglu", False, False, 1.702, 7.0)
    with pytest.raises(NotImplementedError, match="double backward"):
        outputs[0].sum().backward()
