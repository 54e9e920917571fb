"""Shared kernel checks, run by the interpreter tests (CPU) and the GPU tests.

``layout`` is a name in ``moeblaze_ops.testing.LAYOUTS``: "concatenated", "transposed",
"interleaved" or "transposed_interleaved" (the weight layout and the gate/up column order
are independent arguments).
"""

import contextlib

import torch

from moeblaze_ops import moe_experts
from moeblaze_ops.kernels.torch_backend import dispatch as torch_dispatch
from moeblaze_ops.testing import make_layer, make_topk_ids, reference_moe, rel_err, router_grad_scale

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def check_forward(L, d, I, E, K, *, dtype, device, seed, activation="swiglu", layout="concatenated",
                  bias=False, routing="uniform", sentinel_frac=0.0, tw_dtype=None, differentiated=False):
    """Triton forward vs the float64 reference; outputs poisoned; two runs bitwise equal.
    ``differentiated``: x requires grad, so the forward is the training route (h kept for
    backward) rather than the one without gradients."""
    layer = make_layer(L, d, I, E, K, dtype=dtype, activation=activation, layout=layout,
                       bias=bias, routing=routing, sentinel_frac=sentinel_frac, seed=seed, tw_dtype=tw_dtype)
    on_dev = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in layer.items()}
    if differentiated:
        on_dev["x"] = on_dev["x"].detach().requires_grad_(True)
    out = moe_experts(**on_dev, limit=1.5 if dtype == torch.float32 else 7.0).detach()
    again = moe_experts(**on_dev, limit=1.5 if dtype == torch.float32 else 7.0).detach()
    ref = reference_moe(**{k: (v.detach().double() if torch.is_tensor(v) and v.is_floating_point() else v)
                           for k, v in on_dev.items()}, limit=1.5 if dtype == torch.float32 else 7.0)
    assert out.dtype == dtype and out.shape == (L, d)
    assert not torch.isnan(out).any(), f"unwritten output (poisoned NaN) seed={seed}"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"rel err {err} > {TOL[dtype]} seed={seed}"
    assert torch.equal(out, again), f"two runs differ seed={seed}"
    return err


def check_dispatch_bitwise(L, K, E, *, device, routing="uniform", sentinel_frac=0.0, seed=0):
    ids = make_topk_ids(L, K, E, routing, sentinel_frac=sentinel_frac, generator=torch.Generator().manual_seed(seed))
    got = torch.ops.moeblaze.dispatch(ids.to(device), E)
    want = torch_dispatch.dispatch(ids, E)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w), f"seed={seed}"


def check_id_defects(ids, E, *, negative_at, repeat_in, device="cuda"):
    """The Triton dispatch's id flags (``[negative, repeated]``) on valid ``ids`` of ``E``
    experts, then with one defect each: a negative id at ``negative_at`` (token, k), the
    last choice of token ``repeat_in`` repeating its first, and every token's first two
    choices a sentinel (sentinels may repeat)."""
    from moeblaze_ops.kernels.triton_backend.dispatch import invalid_id_flags

    K = ids.shape[1]
    assert invalid_id_flags(ids.to(device), E).tolist() == [0, 0]
    bad = ids.clone()
    bad[negative_at] = -3
    assert invalid_id_flags(bad.to(device), E).tolist() == [1, 0]
    if K > 1:
        bad = ids.clone()
        bad[repeat_in, K - 1] = bad[repeat_in, 0]
        assert invalid_id_flags(bad.to(device), E).tolist() == [0, 1]
        bad = ids.clone()
        bad[:, :2] = E + 1
        assert invalid_id_flags(bad.to(device), E).tolist() == [0, 0]


GRAD_ARGS = ("x", "topk_weights", "w_gate_up", "w_down", "b_gate_up", "b_down")


def check_backward(L, d, I, E, K, *, dtype, device, seed, activation="swiglu", layout="concatenated",
                   bias=False, routing="uniform", sentinel_frac=0.0, tw_dtype=None, recompute=False):
    """Every gradient of the layer vs the float64 reference; two runs bitwise equal.
    ``recompute`` runs moe_experts(..., recompute=True) (h recomputed, dH written over it)."""
    layer = make_layer(L, d, I, E, K, dtype=dtype, activation=activation, layout=layout,
                       bias=bias, routing=routing, sentinel_frac=sentinel_frac, seed=seed, tw_dtype=tw_dtype)
    limit = 1.5 if dtype == torch.float32 else 7.0
    names = [k for k in GRAD_ARGS if layer[k] is not None]
    grad_out = torch.randn(L, d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)

    def grads(to_dev, ref=False):
        inputs = {k: (to_dev(v).requires_grad_(k in names) if torch.is_tensor(v) and v.is_floating_point()
                      else (v.to(device) if torch.is_tensor(v) else v)) for k, v in layer.items()}
        out = reference_moe(**inputs, limit=limit) if ref else moe_experts(**inputs, limit=limit, recompute=recompute)
        g = grad_out.to(device=device, dtype=out.dtype)
        return torch.autograd.grad(out, [inputs[k] for k in names], g)

    got = grads(lambda v: v.to(device).detach())
    again = grads(lambda v: v.to(device).detach())
    ref = grads(lambda v: v.to(device).detach().double(), ref=True)
    layer64 = {k: (v.to(device).double() if torch.is_tensor(v) and v.is_floating_point() else
                   (v.to(device) if torch.is_tensor(v) else v)) for k, v in layer.items()}
    for name, g, g2, r in zip(names, got, again, ref):
        assert g.dtype == layer[name].dtype and g.shape == layer[name].shape
        assert not torch.isnan(g).any(), f"grad {name}: unwritten (poisoned NaN) seed={seed}"
        err = rel_err(g, r)
        if name == "topk_weights":  # dot products: error relative to the scale of their terms
            err = (g.double() - r).norm().item() / router_grad_scale(grad_out.to(device), **layer64,
                                                                     limit=limit).item()
        assert err <= TOL[dtype], f"grad {name}: rel err {err} > {TOL[dtype]} seed={seed}"
        assert torch.equal(g, g2), f"grad {name}: two runs differ seed={seed}"


def check_frozen_grads(L, d, I, E, K, *, trainable, dtype, device, seed, recompute=False, bias=True):
    """Only ``trainable`` inputs require grad: their gradients equal those of a run where
    everything requires grad. Returns the backward ops called, each with the ``need_*``
    flags it received, so callers can check what was skipped."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Flags(TorchDispatchMode):
        calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name.startswith("moeblaze.expert_") and name.endswith(("backward", "backward_", "backward_recompute")):
                # Trailing arguments equal to their defaults may be left out of args.
                schema = func._schema.arguments
                values = {a.name: (args[i] if i < len(args) else (kwargs or {}).get(a.name, a.default_value))
                          for i, a in enumerate(schema)}
                Flags.calls.append((name.split(".")[1], {k: v for k, v in values.items() if k.startswith("need_")}))
            return func(*args, **(kwargs or {}))

    layer = make_layer(L, d, I, E, K, dtype=dtype, bias=bias, seed=seed, tw_dtype=torch.float32)
    names = [k for k in GRAD_ARGS if layer[k] is not None]
    grad_out = torch.randn(L, d, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)

    def grads(wanted, mode=None):
        inputs = {k: (v.to(device).detach().requires_grad_(k in wanted) if torch.is_tensor(v) and v.is_floating_point()
                      else (v.to(device) if torch.is_tensor(v) else v)) for k, v in layer.items()}
        with mode or contextlib.nullcontext():
            out = moe_experts(**inputs, recompute=recompute)
            return dict(zip(wanted, torch.autograd.grad(out, [inputs[k] for k in wanted], grad_out)))

    full = grads(names)
    Flags.calls = []
    part = grads([k for k in names if k in trainable], Flags())
    for k, g in part.items():
        assert torch.equal(g, full[k]), f"grad {k} differs when other inputs are frozen seed={seed}"
    return Flags.calls
