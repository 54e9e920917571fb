"""Bad input gets a ValueError that names the argument: never a wrong answer or a crash."""

import pytest
import torch

from moeblaze_ops import moe_experts
from moeblaze_ops.testing import make_layer

ops = torch.ops.moeblaze


@pytest.fixture
def layer(seed):
    return make_layer(6, 8, 6, 4, 2, seed=seed, bias=True)  # d=8, N=2I=12: b_gate_up and b_down differ


def _with(layer, **changes):
    return {**layer, **changes}


FRONT_DOOR_CASES = {
    # name: (changes as a function of the layer, argument named in the error)
    "x_int": (lambda l: dict(x=l["x"].long()), "x"),
    "x_not_tensor": (lambda l: dict(x=l["x"].tolist()), "x"),
    "x_rank1": (lambda l: dict(x=l["x"][0], topk_ids=l["topk_ids"][0], topk_weights=l["topk_weights"][0]), "x"),
    "ids_float": (lambda l: dict(topk_ids=l["topk_ids"].float()), "topk_ids"),
    "ids_rows": (lambda l: dict(topk_ids=l["topk_ids"][:5]), "topk_ids"),
    "weights_int": (lambda l: dict(topk_weights=l["topk_weights"].long()), "topk_weights"),
    "weights_K": (lambda l: dict(topk_weights=l["topk_weights"][:, :1]), "topk_weights"),
    "w_gate_up_rank": (lambda l: dict(w_gate_up=l["w_gate_up"][0]), "w_gate_up"),
    "w_gate_up_dtype": (lambda l: dict(w_gate_up=l["w_gate_up"].double()), "w_gate_up"),
    "w_gate_up_d": (lambda l: dict(w_gate_up=l["w_gate_up"][:, :, :5]), "w_gate_up"),
    "w_gate_up_odd": (lambda l: dict(w_gate_up=l["w_gate_up"][:, :7]), "w_gate_up"),
    "w_down_E": (lambda l: dict(w_down=l["w_down"][:3]), "w_down"),
    "w_down_I": (lambda l: dict(w_down=l["w_down"][:, :, :3]), "w_down"),
    "w_down_d": (lambda l: dict(w_down=l["w_down"][:, :5]), "w_down"),
    "w_down_device": (lambda l: dict(w_down=l["w_down"].to("meta")), "w_down"),
    "b_gate_up_shape": (lambda l: dict(b_gate_up=l["b_gate_up"][:3]), "b_gate_up"),
    "b_down_shape": (lambda l: dict(b_down=l["b_down"][:, :4]), "b_down"),
    "b_down_dtype": (lambda l: dict(b_down=l["b_down"].half()), "b_down"),
    "activation": (lambda l: dict(activation="swish"), "activation"),
    "negative_id": (lambda l: dict(topk_ids=l["topk_ids"].index_fill(1, torch.tensor([0]), -1)), "topk_ids"),
    "duplicate_id": (lambda l: dict(topk_ids=l["topk_ids"][:, :1].repeat(1, 2)), "topk_ids"),
}


@pytest.mark.parametrize("case", list(FRONT_DOOR_CASES))
def test_front_door_rejects(layer, case):
    change, arg = FRONT_DOOR_CASES[case]
    with pytest.raises(ValueError, match=f"'{arg}'"):
        moe_experts(**_with(layer, **change(layer)))


def test_duplicate_sentinels_are_allowed(layer):
    E = layer["w_gate_up"].shape[0]
    ids = layer["topk_ids"].clone()
    ids[0] = E  # both choices of token 0 belong to another rank
    out = moe_experts(**_with(layer, topk_ids=ids))
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def _op_args(layer):
    E = layer["w_gate_up"].shape[0]
    eti, offsets, tim = ops.dispatch(layer["topk_ids"], E)
    h = ops.expert_up(layer["x"], layer["w_gate_up"], eti, offsets, tim, None, False)
    return eti, offsets, tim, h


def test_dispatch_rejects(layer):
    ids = layer["topk_ids"]
    with pytest.raises(ValueError, match="'topk_ids'"):
        ops.dispatch(ids.float(), 4)
    with pytest.raises(ValueError, match="'topk_ids'"):
        ops.dispatch(ids.reshape(-1), 4)
    with pytest.raises(ValueError, match="'num_experts'"):
        ops.dispatch(ids, 0)
    with pytest.raises(ValueError, match="'topk_ids'.*negative"):
        ops.dispatch(ids - 10, 4)
    with pytest.raises(ValueError, match="'topk_ids'.*repeated"):
        ops.dispatch(ids[:, :1].repeat(1, 2), 4)


def test_expert_up_rejects(layer):
    eti, offsets, tim, _ = _op_args(layer)
    x, w = layer["x"], layer["w_gate_up"]
    with pytest.raises(ValueError, match="'expert_offsets'"):
        ops.expert_up(x, w, eti, offsets[:-1], tim)
    with pytest.raises(ValueError, match="'expert_token_indices'"):
        ops.expert_up(x, w, eti.long(), offsets, tim)
    with pytest.raises(ValueError, match="'token_index_map'"):
        ops.expert_up(x, w, eti, offsets, tim[:-1])
    with pytest.raises(ValueError, match="'token_index_map'"):
        ops.expert_up(x[:5], w, eti, offsets, tim)  # 12 routed rows are not L*K for L=5
    with pytest.raises(ValueError, match="'w_gate_up'"):
        ops.expert_up(x, w, eti, offsets, tim, None, True)  # [E, N, d] is not [E, d, N]
    with pytest.raises(ValueError, match="'b_gate_up'"):
        ops.expert_up(x, w, eti, offsets, tim, layer["b_down"])


def test_expert_down_rejects(layer):
    eti, offsets, tim, h = _op_args(layer)
    wd, tw = layer["w_down"], layer["topk_weights"]
    with pytest.raises(ValueError, match="'h'"):
        ops.expert_down(h[:, :7], wd, eti, offsets, tim, tw)
    with pytest.raises(ValueError, match="'h'"):
        ops.expert_down(h[:-2], wd, eti, offsets, tim, tw)
    with pytest.raises(ValueError, match="'topk_weights'"):
        ops.expert_down(h, wd, eti, offsets, tim, tw[:, :1])
    with pytest.raises(ValueError, match="'w_down'"):
        ops.expert_down(h, wd, eti, offsets, tim, tw, None, "relu")  # relu needs w_down with I = 12
    with pytest.raises(ValueError, match="'activation'"):
        ops.expert_down(h, wd, eti, offsets, tim, tw, None, "tanh")
    with pytest.raises(ValueError, match="'b_down'"):
        ops.expert_down(h, wd, eti, offsets, tim, tw, layer["b_gate_up"])


def test_backward_ops_reject_bad_gradients(layer):
    eti, offsets, tim, h = _op_args(layer)
    x, wgu, wd, tw = layer["x"], layer["w_gate_up"], layer["w_down"], layer["topk_weights"]
    with pytest.raises(ValueError, match="'grad_h'"):
        ops.expert_up_backward(h[:, :4], x, wgu, eti, offsets, tim, False, False)
    with pytest.raises(ValueError, match="'grad_h'"):
        ops.expert_up_backward(h.long(), x, wgu, eti, offsets, tim, False, False)
    with pytest.raises(ValueError, match="'grad_out'"):
        ops.expert_down_backward(x[:3], h, wd, eti, offsets, tim, tw, None, "swiglu", False, False, 1.702, 7.0)


def test_backward_checks_allocate_nothing(layer):
    """The backward ops' argument checks build no tensors: a check that made an [L*K, N]
    tensor to compare grad_h against doubled recompute mode's peak memory on the GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moeblaze_ops.ops.experts import _check_down_backward, _check_up_backward

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    eti, offsets, tim, h = _op_args(layer)
    x, wgu, wd, tw = layer["x"], layer["w_gate_up"], layer["w_down"], layer["topk_weights"]
    with Allocations() as mode:
        _check_up_backward(h, x, wgu, eti, offsets, tim, False)
        _check_down_backward(x, h, wd, eti, offsets, tim, tw, None, "swiglu", False)
    assert mode.ops == []
