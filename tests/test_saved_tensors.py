"""What backward keeps: x, h, the three index arrays and topk_weights (plus parameters)."""

import pytest
import torch

from moeblaze_ops import moe_experts
from moeblaze_ops.testing import make_layer


def _saved_during(fn):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_backward_keeps_only_h_and_indices(activation, bias, seed):
    L, d, I, E, K = 16, 12, 5, 4, 2
    layer = make_layer(L, d, I, E, K, activation=activation, bias=bias, seed=seed, requires_grad=True)
    out, saved = _saved_during(lambda: moe_experts(**layer))
    params = {layer[k].data_ptr() for k in ("w_gate_up", "w_down", "b_gate_up", "b_down") if layer[k] is not None}
    activations = [t for t in saved if t.data_ptr() not in params]
    # Unique storages: the same tensor saved by two ops counts once.
    unique = {(t.data_ptr(), tuple(t.shape), t.dtype): t for t in activations}
    N = 2 * I if activation == "swiglu" else I
    kinds = sorted((tuple(t.shape), str(t.dtype)) for t in unique.values())
    assert kinds == sorted([
        ((L, d), "torch.float32"),        # x, the layer input
        ((L * K, N), "torch.float32"),    # h
        ((L * K,), "torch.int32"),        # expert_token_indices
        ((E + 1,), "torch.int32"),        # expert_offsets
        ((L * K,), "torch.int32"),        # token_index_map
        ((L, K), "torch.float32"),        # topk_weights
    ])
    x_saved = [t for t in unique.values() if t.shape == (L, d)]
    assert x_saved[0].data_ptr() == layer["x"].data_ptr()  # the input itself, not a copy
    # The recompute really is a recompute: backward still works from these alone.
    out.sum().backward()
    assert layer["x"].grad is not None and layer["topk_weights"].grad is not None


@pytest.mark.parametrize("bias", [False, True])
def test_recompute_mode_keeps_no_activation(bias, seed):
    L, d, I, E, K = 16, 12, 5, 4, 2
    layer = make_layer(L, d, I, E, K, bias=bias, seed=seed, requires_grad=True, dtype=torch.float64)
    out, saved = _saved_during(lambda: moe_experts(**layer, recompute=True))
    params = {layer[k].data_ptr() for k in ("w_gate_up", "w_down", "b_gate_up", "b_down") if layer[k] is not None}
    kept = {(t.data_ptr(), tuple(t.shape), t.dtype): t for t in saved if t.data_ptr() not in params}
    kinds = sorted((tuple(t.shape), str(t.dtype)) for t in kept.values())
    assert kinds == sorted([((L, d), "torch.float64"), ((L * K,), "torch.int32"), ((E + 1,), "torch.int32"),
                            ((L * K,), "torch.int32"), ((L, K), "torch.float64")])  # no h
    names = [k for k in ("x", "topk_weights", "w_gate_up", "w_down", "b_gate_up", "b_down") if layer[k] is not None]
    grads = torch.autograd.grad(out.sum(), [layer[k] for k in names])
    ref = torch.autograd.grad(moe_experts(**layer).sum(), [layer[k] for k in names])
    for g, r in zip(grads, ref):
        assert torch.allclose(g, r, rtol=1e-12, atol=1e-12)


def test_recompute_mode_gradcheck(seed):
    layer = make_layer(5, 4, 3, 3, 2, dtype=torch.float64, bias=True, seed=seed, requires_grad=True)
    names = [k for k in ("x", "topk_weights", "w_gate_up", "w_down", "b_gate_up", "b_down")]
    f = lambda *t: moe_experts(**{**layer, **dict(zip(names, t))}, recompute=True)  # noqa: E731
    assert torch.autograd.gradcheck(f, [layer[k] for k in names])


def _compiled_saved_shapes(fn, *args):
    """Shapes of the tensors the compiled forward graph hands to backward (AOTAutograd with
    Inductor's partitioner, which merges identical ops across forward and backward)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    captured = {}

    def backend(gm, example_inputs):
        def fw(g, _):
            captured["forward"] = g
            return g
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, bw_compiler=lambda g, _: g,
                                     partition_fn=min_cut_rematerialization_partition)

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args).sum().backward()
    outputs = next(n for n in captured["forward"].graph.nodes if n.op == "output").args[0]
    return [tuple(o.meta["val"].shape) for o in outputs[1:] if hasattr(o, "meta") and "val" in o.meta]


@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_forward_saves_h_only_without_recompute(recompute, seed):
    """Under torch.compile the partitioner decides what is saved: recompute mode must still
    hand backward no [L*K, N] tensor (its backward recomputes h inside one op, which the
    compiler cannot merge with the forward's expert_up), and the default mode exactly one."""
    L, d, I, E, K = 16, 12, 5, 4, 2
    layer = make_layer(L, d, I, E, K, bias=True, seed=seed, requires_grad=True)
    shapes = _compiled_saved_shapes(lambda kw: moe_experts(**kw, recompute=recompute), layer)
    assert shapes.count((L * K, 2 * I)) == (0 if recompute else 1), shapes
