"""torch.library.opcheck on every moeblaze op over edge-case shapes and every variant."""

import pytest
import torch

from moeblaze_ops import ACTIVATIONS, is_gated
from moeblaze_ops.testing import LAYOUTS, make_layer

TEST_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
)

# (L, d, I, E, K, routing, sentinel_frac)
CASES = {
    "basic": (9, 8, 6, 4, 2, "uniform", 0.0),
    "K1": (7, 8, 4, 3, 1, "uniform", 0.0),
    "E1": (6, 4, 4, 1, 1, "uniform", 0.0),
    "L1": (1, 8, 4, 4, 3, "uniform", 0.0),
    "empty_expert": (8, 4, 4, 5, 2, "no_last", 0.0),
    "one_expert": (10, 4, 6, 4, 1, "first", 0.0),
    "sentinels": (11, 4, 4, 4, 2, "uniform", 0.35),
}


def op_args(layer):
    ops = torch.ops.moeblaze
    ids = layer["topk_ids"]
    E = layer["w_gate_up"].shape[0]
    eti, offsets, tim = ops.dispatch(ids, E)
    x, wgu, wd, tw = layer["x"], layer["w_gate_up"], layer["w_down"], layer["topk_weights"]
    bgu, bd, tr = layer["b_gate_up"], layer["b_down"], layer["transposed"]
    act, il = layer["activation"], layer["interleaved"]
    with torch.no_grad():
        h = ops.expert_up(x, wgu, eti, offsets, tim, bgu, tr)
        out = ops.expert_down(h, wd, eti, offsets, tim, tw, bd, act, tr, il, 1.702, 1.0)
    h = h.detach().requires_grad_(True)
    detached = lambda t: None if t is None else t.detach()  # noqa: E731
    return {
        "dispatch": (ids, E),
        "expert_up": (x, wgu, eti, offsets, tim, bgu, tr),
        "expert_down": (h, wd, eti, offsets, tim, tw, bd, act, tr, il, 1.702, 1.0),
        "expert_up_backward": (torch.randn_like(h).detach(), x.detach(), wgu.detach(), eti, offsets, tim,
                               bgu is not None, tr),
        "expert_down_backward": (torch.randn_like(out), h.detach(), wd.detach(), eti, offsets, tim,
                                 tw.detach(), detached(bd), act, tr, il, 1.702, 1.0),
        "expert_down_backward_": (torch.randn_like(out), h.detach().clone(), wd.detach(), eti, offsets, tim,
                                  tw.detach(), detached(bd), act, tr, il, 1.702, 1.0),
        "expert_down_backward_recompute": (torch.randn_like(out), x.detach(), wgu.detach(), wd.detach(), eti,
                                           offsets, tim, tw.detach(), detached(bgu), detached(bd), act, tr, il,
                                           1.702, 1.0),
        "expert_layer": (x, wgu, wd, eti, offsets, tim, tw, bgu, bd, act, tr, il, 1.702, 1.0),
    }


OPS = ["dispatch", "expert_up", "expert_down", "expert_up_backward", "expert_down_backward",
       "expert_down_backward_", "expert_down_backward_recompute", "expert_layer"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(CASES))
def test_opcheck_shapes(op, case, seed):
    L, d, I, E, K, routing, sf = CASES[case]
    layer = make_layer(L, d, I, E, K, routing=routing, sentinel_frac=sf, bias=True, seed=seed,
                       requires_grad=True)
    args = op_args(layer)[op]
    torch.library.opcheck(getattr(torch.ops.moeblaze, op).default, args, test_utils=TEST_UTILS)


# The up ops take neither the activation (only N, 2I or I) nor ``interleaved``.
UP_OPS = ("expert_up", "expert_up_backward")
# The checks of the ops' registration (schema: mutations and aliasing of the real kernel;
# autograd registration; fake function vs kernel on real inputs), quick to run.
REGISTRATION_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
# The AOTAutograd traces (about 90% of opcheck's time) depend only on the shapes the fake
# function gives; the activation changes them only through N (2I if gated, else I).
AOT_UTILS = ("test_aot_dispatch_static", "test_aot_dispatch_dynamic")


def _variants(distinct_shapes=False):
    """(op, activation, layout) for every op and every distinct set of arguments it gets:
    an op that does not read a flag is not run once per value of it. ``distinct_shapes``:
    one activation per set of shapes, taking the gated and the plain activations in turn
    so that each appears."""
    seen, variants, taken = set(), [], {}
    for op in OPS[1:]:
        for activation in ACTIVATIONS:
            for layout, (transposed, interleaved) in LAYOUTS.items():
                gated = is_gated(activation)
                if op in UP_OPS or distinct_shapes:
                    key = (op, gated, transposed, interleaved and gated and op not in UP_OPS)
                else:  # interleaved orders gate and up columns: nothing to order without a gate
                    key = (op, activation, transposed, interleaved and gated)
                if key in seen:
                    continue
                seen.add(key)
                if distinct_shapes:
                    taken[gated] = taken.get(gated, -1) + 1
                    same_kind = [a for a in ACTIVATIONS if is_gated(a) == gated]
                    activation_used = same_kind[taken[gated] % len(same_kind)]
                else:
                    activation_used = activation
                variants.append(pytest.param(op, activation_used, layout, id=f"{op}-{activation_used}-{layout}"))
    return variants


def _variant_layer(activation, layout, seed):
    transposed = LAYOUTS[layout][0]  # biases with the transposed layouts, as GPT-OSS has
    return make_layer(6, 8, 4, 3, 2, activation=activation, layout=layout, bias=transposed, seed=seed,
                      requires_grad=True)


@pytest.mark.parametrize("op,activation,layout", _variants())
def test_opcheck_variants(op, activation, layout, seed):
    """Every activation and layout: the schema matches what the kernel does (no undeclared
    mutation or alias), and the fake function the kernel's outputs."""
    layer = _variant_layer(activation, layout, seed)
    torch.library.opcheck(getattr(torch.ops.moeblaze, op).default, op_args(layer)[op],
                          test_utils=REGISTRATION_UTILS)


@pytest.mark.parametrize("op,activation,layout", _variants(distinct_shapes=True))
def test_opcheck_variants_traced(op, activation, layout, seed):
    """Every layout and both activation kinds, traced by AOTAutograd with static and
    dynamic shapes."""
    layer = _variant_layer(activation, layout, seed)
    torch.library.opcheck(getattr(torch.ops.moeblaze, op).default, op_args(layer)[op], test_utils=AOT_UTILS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_half(dtype, seed):
    layer = make_layer(8, 8, 4, 4, 2, dtype=dtype, tw_dtype=torch.float32, seed=seed, requires_grad=True)
    args = op_args(layer)
    for op in OPS:
        torch.library.opcheck(getattr(torch.ops.moeblaze, op).default, args[op], test_utils=TEST_UTILS)


@pytest.mark.parametrize("flags", [(True, False), (False, True), (False, False)])
def test_opcheck_backward_ops_skipping_gradients(flags, seed):
    """The need_* flags of the backward ops (frozen experts or input): empty outputs for
    what is not needed, in the fake functions as in the kernels."""
    layer = make_layer(9, 8, 6, 4, 2, bias=True, seed=seed, requires_grad=True)
    args = op_args(layer)
    ops = torch.ops.moeblaze
    torch.library.opcheck(ops.expert_up_backward.default, args["expert_up_backward"] + flags, test_utils=TEST_UTILS)
    for op in ("expert_down_backward", "expert_down_backward_", "expert_down_backward_recompute"):
        torch.library.opcheck(getattr(ops, op).default, args[op] + flags[1:], test_utils=TEST_UTILS)


# --------------------------------------------------------------------------- called as a user calls them


def user_call(layer, op):
    """``(args, kwargs)`` of ``op`` called as a user calls it: the required arguments, and
    keywords only where they differ from the defaults (the dispatcher then drops the
    omitted ones, and a formula sees fewer arguments than the schema has)."""
    ops = torch.ops.moeblaze
    x, wgu, wd, tw = layer["x"], layer["w_gate_up"], layer["w_down"], layer["topk_weights"]
    E = wgu.shape[0]
    eti, offsets, tim = ops.dispatch(layer["topk_ids"], E)
    up_kwargs = {k: v for k, v in (("b_gate_up", layer["b_gate_up"]), ("transposed", layer["transposed"]))
                 if v is not None and v is not False}
    act_kwargs = {k: v for k, v in (("b_down", layer["b_down"]), ("transposed", layer["transposed"]),
                                    ("interleaved", layer["interleaved"])) if v is not None and v is not False}
    if layer["activation"] != "swiglu":
        act_kwargs["activation"] = layer["activation"]
    with torch.no_grad():
        h = ops.expert_up(x, wgu, eti, offsets, tim, **up_kwargs)
    h.requires_grad_(True)
    if op == "dispatch":
        return (layer["topk_ids"], E), {}
    if op == "expert_up":
        return (x, wgu, eti, offsets, tim), up_kwargs
    if op == "expert_down":
        return (h, wd, eti, offsets, tim, tw), act_kwargs
    layer_kwargs = {**act_kwargs, **({"b_gate_up": layer["b_gate_up"]} if layer["b_gate_up"] is not None else {})}
    return (x, wgu, wd, eti, offsets, tim, tw), layer_kwargs


FORWARD_OPS = ("dispatch", "expert_up", "expert_down", "expert_layer")


def _user_variants(distinct_shapes=False):
    """(op, activation, layout, bias) for every forward op; ``distinct_shapes``: one
    activation of each kind (gated, plain) per layout and bias, for the slower traces."""
    variants = []
    for op in FORWARD_OPS:
        for layout in LAYOUTS:
            for bias in (False, True):
                activations = ("swiglu", "gelu") if distinct_shapes else ACTIVATIONS
                for activation in activations:
                    variants.append(pytest.param(op, activation, layout, bias, id=f"{op}-{activation}-{layout}-"
                                                 f"{'bias' if bias else 'nobias'}"))
    return variants


def _user_layer(activation, layout, bias, seed):
    return make_layer(6, 8, 4, 3, 2, activation=activation, layout=layout, bias=bias, seed=seed,
                      requires_grad=True)


@pytest.mark.parametrize("op,activation,layout,bias", _user_variants())
def test_opcheck_as_users_call(op, activation, layout, bias, seed):
    """Every forward op, every activation, layout and bias, called with the defaults left
    out: the registration checks (schema, autograd registration, fake function), then one
    backward through the op's formula."""
    layer = _user_layer(activation, layout, bias, seed)
    args, kwargs = user_call(layer, op)
    packet = getattr(torch.ops.moeblaze, op)
    torch.library.opcheck(packet.default, args, kwargs, test_utils=REGISTRATION_UTILS)
    if op == "dispatch":
        return
    out = packet(*args, **kwargs)
    out.backward(torch.randn_like(out))
    for arg in list(args) + list(kwargs.values()):
        if torch.is_tensor(arg) and arg.requires_grad:
            assert arg.grad is not None and torch.isfinite(arg.grad).all()


@pytest.mark.parametrize("op,activation,layout,bias", _user_variants(distinct_shapes=True))
def test_opcheck_as_users_call_traced(op, activation, layout, bias, seed):
    """The same calls traced by AOTAutograd (forward and backward, static shapes)."""
    layer = _user_layer(activation, layout, bias, seed)
    args, kwargs = user_call(layer, op)
    torch.library.opcheck(getattr(torch.ops.moeblaze, op).default, args, kwargs,
                          test_utils=("test_aot_dispatch_static",))


# --------------------------------------------------------------------------- the internal pair


@pytest.mark.parametrize("activation,layout", [("swiglu", "concatenated"), ("clamped_swiglu", "transposed_interleaved"),
                                               ("gelu", "concatenated")])
@pytest.mark.parametrize("case", ["basic", "sentinels"])
def test_activation_beside_h_ops(activation, layout, case, seed):
    """The internal pair a training layer runs where its up projection writes act(h) beside
    h: opcheck of each; ``_expert_up_beside``'s h is ``expert_up``'s, and
    ``_expert_down_activated`` on its act(h) gives ``expert_down`` of that h."""
    L, d, I, E, K, routing, sf = CASES[case]
    layer = make_layer(L, d, I, E, K, routing=routing, sentinel_frac=sf, activation=activation, layout=layout,
                       bias=True, seed=seed)
    args = {op: tuple(a.detach() if torch.is_tensor(a) else a for a in op_args(layer)[op])
            for op in ("expert_up", "expert_down")}
    h_args, down_args = args["expert_up"], args["expert_down"]
    activation_args = (activation, layer["interleaved"]) + down_args[-2:]  # alpha, limit
    ops = torch.ops.moeblaze
    up_args = h_args + activation_args
    torch.library.opcheck(ops._expert_up_beside.default, up_args, test_utils=TEST_UTILS)
    h, a = ops._expert_up_beside(*up_args)
    assert torch.equal(h, ops.expert_up(*h_args))
    transposed = layer["transposed"]
    # w_down, the index arrays, topk_weights, b_down
    activated_args = (a,) + down_args[1:7] + (transposed, is_gated(activation))
    torch.library.opcheck(ops._expert_down_activated.default, activated_args, test_utils=TEST_UTILS)
    out = ops._expert_down_activated(*activated_args)
    expected = ops.expert_down(h, *down_args[1:])
    assert (out - expected).norm() <= 1e-6 * expected.norm()
