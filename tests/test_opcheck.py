"""torch.library.opcheck on every moeblaze op over edge-case shapes and every variant."""

import pytest
import torch

from conftest import make_layer
from moeblaze_ops import ACTIVATIONS

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
    }


OPS = ["dispatch", "expert_up", "expert_down", "expert_up_backward", "expert_down_backward",
       "expert_down_backward_", "expert_down_backward_recompute"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(CASES))
def test_opcheck_shapes(op, case, seed):
    L, d, I, E, K, routing, sf = CASES[case]
    layer = make_layer(L, d, I, E, K, routing=routing, sentinel_frac=sf, bias=True, seed=seed,
                       requires_grad=True)
    args = op_args(layer)[op]
    torch.library.opcheck(getattr(torch.ops.moeblaze, op).default, args, test_utils=TEST_UTILS)


@pytest.mark.parametrize("op", OPS[1:])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["concatenated", "transposed_interleaved"])
def test_opcheck_variants(op, activation, layout, seed):
    tr = layout != "concatenated"
    layer = make_layer(6, 8, 4, 3, 2, activation=activation, transposed=tr, interleaved=tr, bias=tr,
                       seed=seed, requires_grad=True)
    torch.library.opcheck(getattr(torch.ops.moeblaze, op).default, op_args(layer)[op], test_utils=TEST_UTILS)


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
