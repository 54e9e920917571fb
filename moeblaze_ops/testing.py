"""Test helpers shared by the tests, the examples and the scripts: random layers, seeds and
an independent float64 reference of the experts layer.

Nothing here is imported by ``import moeblaze_ops``; it needs only torch (no pytest).

- ``make_layer``, ``make_topk_ids``: random inputs of ``moe_experts`` in every layout
  (``LAYOUTS``) and routing.
- ``seed_for``: the seed of one test, fixed by default (``MOEBLAZE_TEST_SEED``).
- ``reference_moe``, ``router_grad_scale``: the plain sort-and-permute MoE, written for
  the tests without moeblaze_ops code (activations from ``torch.nn.functional``), and
  the scale of the router gradient's rounding error. ``reference_moe_fp8``: the same
  layer in the FP8 recipe (operands through e4m3 in the formats of ``moeblaze_ops.fp8``).
- ``rel_err``: the relative error of a result against a reference, in float64.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
from typing import Optional

import torch
import torch.nn.functional as F

from .activations import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT, is_gated

__all__ = [
    "LAYOUTS",
    "SEED_ENV",
    "base_seed",
    "seed_for",
    "current_test_seed",
    "layout_flags",
    "make_topk_ids",
    "make_layer",
    "rel_err",
    "reference_activation",
    "reference_moe",
    "reference_moe_fp8",
    "router_grad_scale",
]

#: Weight layouts of the experts layer: name -> (transposed, interleaved). ``transposed``:
#: ``w_gate_up`` is [E, d, N] and ``w_down`` [E, I, d] (instead of [E, N, d] and [E, d, I]);
#: ``interleaved``: the gate and up columns of ``w_gate_up`` alternate (instead of being two
#: halves). The two are independent arguments of ``moe_experts``.
LAYOUTS = {
    "concatenated": (False, False),
    "transposed": (True, False),
    "interleaved": (False, True),
    "transposed_interleaved": (True, True),
}

#: The environment variable that picks the base seed: an integer, or ``random``.
SEED_ENV = "MOEBLAZE_TEST_SEED"


def layout_flags(layout: str) -> dict:
    """``dict(transposed=..., interleaved=...)`` of a name in ``LAYOUTS``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {list(LAYOUTS)}")
    transposed, interleaved = LAYOUTS[layout]
    return dict(transposed=transposed, interleaved=interleaved)


@functools.lru_cache(maxsize=None)
def _base_seed(setting: str) -> int:
    # Cached per setting: ``random`` draws once per process, so every test of a run
    # derives its seed from the same base, and the base printed once reproduces them all.
    if setting == "random":
        return random.SystemRandom().randrange(2**31)
    try:
        return int(setting)
    except ValueError:
        raise ValueError(f"{SEED_ENV} must be an integer or 'random', got {setting!r}") from None


def base_seed() -> int:
    """The base of every test seed: ``MOEBLAZE_TEST_SEED`` (an integer, or ``random`` for one
    drawn once per process); 0 when unset, so runs repeat exactly."""
    return _base_seed(os.environ.get(SEED_ENV, "0").strip() or "0")


def seed_for(node_id: str, base: Optional[int] = None) -> int:
    """The seed of the test ``node_id`` (pytest's ``request.node.nodeid``): a stable hash of
    the base seed and the id, so a run repeats exactly while different tests (and the
    parametrizations of one test) still draw different inputs.

    ``base`` defaults to ``base_seed()``. A hash of the text, not Python's ``hash``, which
    is salted per process.
    """
    base = base_seed() if base is None else base
    digest = hashlib.blake2b(f"{base}:{node_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


def current_test_seed() -> int:
    """The seed of the pytest test running now (from ``PYTEST_CURRENT_TEST``), or of no test
    outside pytest: what ``make_layer`` uses when it is given no seed."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    # pytest sets it to "<node id> (<phase>)"; the phase must not change the seed.
    return seed_for(current.rsplit(" (", 1)[0])


def make_topk_ids(L, K, E, routing="uniform", *, sentinel_frac=0.0, generator=None, dtype=torch.int64):
    """[L, K] distinct expert ids per row. routings: uniform, skewed (Zipf-like), first (experts 0..K-1),
    no_last (expert E-1 never chosen). A fraction ``sentinel_frac`` of the entries becomes sentinel
    ids (>= E), which may repeat within a row."""
    g = generator
    if routing == "first":
        ids = torch.arange(K).expand(L, K).clone()
    else:
        E_eff = E - 1 if routing == "no_last" else E
        if not K <= E_eff:
            raise ValueError(f"routing {routing!r} needs K <= {E_eff}, got K={K}")
        if routing == "skewed":
            logits = -1.2 * torch.log(torch.arange(1, E_eff + 1, dtype=torch.float64))
            u = torch.rand(L, E_eff, generator=g, dtype=torch.float64).clamp_min(1e-12)
            scores = logits - torch.log(-torch.log(u))  # Gumbel top-k: sampling without replacement
        elif routing == "uniform" or routing == "no_last":
            scores = torch.rand(L, E_eff, generator=g)
        else:
            raise ValueError(f"unknown routing {routing!r}")
        ids = scores.topk(K, dim=1).indices
    if sentinel_frac > 0:
        mask = torch.rand(L, K, generator=g) < sentinel_frac
        ids = torch.where(mask, torch.full_like(ids, E) + torch.randint(0, 3, ids.shape, generator=g), ids)
    return ids.to(dtype)


def make_layer(L, d, I, E, K, *, dtype=torch.float32, activation="swiglu", layout=None, transposed=False,
               interleaved=False, bias=False, routing="uniform", sentinel_frac=0.0, seed=None,
               requires_grad=False, tw_dtype=None):
    """Random inputs of an experts layer, as a dict of ``moe_experts`` keyword arguments.

    ``layout`` (a name in ``LAYOUTS``) sets ``transposed`` and ``interleaved`` together; pass
    either it or those two. ``seed`` defaults to ``current_test_seed()`` (the running test's).
    Weights are scaled by 1/sqrt(fan-in) so outputs stay O(1) at every size.
    """
    if layout is not None:
        if transposed or interleaved:
            raise ValueError("make_layer: pass layout or transposed/interleaved, not both")
        flags = layout_flags(layout)
        transposed, interleaved = flags["transposed"], flags["interleaved"]
    g = torch.Generator().manual_seed(current_test_seed() if seed is None else seed)
    N = 2 * I if is_gated(activation) else I

    def rnd(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
        return t.requires_grad_(requires_grad)

    w_gate_up = rnd(E, d, N, scale=d ** -0.5) if transposed else rnd(E, N, d, scale=d ** -0.5)
    w_down = rnd(E, I, d, scale=I ** -0.5) if transposed else rnd(E, d, I, scale=I ** -0.5)
    tw = torch.rand(L, K, generator=g, dtype=torch.float64).softmax(-1).to(tw_dtype or dtype)
    return dict(
        x=rnd(L, d),
        topk_ids=make_topk_ids(L, K, E, routing, sentinel_frac=sentinel_frac, generator=g),
        topk_weights=tw.requires_grad_(requires_grad),
        w_gate_up=w_gate_up,
        w_down=w_down,
        activation=activation,
        b_gate_up=rnd(E, N, scale=0.1) if bias else None,
        b_down=rnd(E, d, scale=0.1) if bias else None,
        transposed=transposed,
        interleaved=interleaved,
    )


def rel_err(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in float64 (the absolute error when ``ref`` is zero)."""
    ref = ref.detach().double()
    denom = ref.norm()
    err = (out.detach().double() - ref).norm()
    return float(err / denom) if denom > 0 else float(err)


def reference_activation(h, activation, interleaved=False, alpha=CLAMPED_SWIGLU_ALPHA, limit=CLAMPED_SWIGLU_LIMIT):
    """The activation of ``h`` [..., N] from ``torch.nn.functional`` (not moeblaze_ops code)."""
    if activation in ("silu", "gelu", "relu"):
        return {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[activation](h)
    if interleaved:
        gate, up = h[..., ::2], h[..., 1::2]
    else:
        gate, up = h.chunk(2, dim=-1)
    if activation == "swiglu":
        return F.silu(gate) * up
    if activation == "geglu":
        return F.gelu(gate) * up
    if activation != "clamped_swiglu":
        raise ValueError(f"unknown activation {activation!r}")
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def reference_moe(x, topk_ids, topk_weights, w_gate_up, w_down, activation="swiglu", *, b_gate_up=None,
                  b_down=None, transposed=False, interleaved=False, alpha=CLAMPED_SWIGLU_ALPHA,
                  limit=CLAMPED_SWIGLU_LIMIT):
    """``out[i] = sum_k topk_weights[i, k] * expert_{topk_ids[i, k]}(x[i])``; ids >= E contribute nothing.

    The sort-and-permute dropless MoE: flatten the (token, k) assignments, stable-argsort
    them by expert, gather the token rows into a permuted [L*K, d] buffer, run each expert
    on its slice, then scatter-add each weighted row back to its token. Differentiable
    through autograd; call it with float64 tensors for a reference.
    """
    ys, order, src_tok = _routed_rows(x, topk_ids, w_gate_up, w_down, activation, b_gate_up, b_down, transposed,
                                      interleaved, alpha, limit)
    ys = ys * topk_weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
    out = torch.zeros_like(x)
    return out.index_add(0, src_tok, ys)


def router_grad_scale(grad_out, x, topk_ids, topk_weights, w_gate_up, w_down, activation="swiglu", *,
                      b_gate_up=None, b_down=None, transposed=False, interleaved=False,
                      alpha=CLAMPED_SWIGLU_ALPHA, limit=CLAMPED_SWIGLU_LIMIT):
    """The root-sum-square of the terms of the router gradient's dot products,
    ``sqrt(sum over (i, k) and c of (grad_out[i, c] * y_ik[c])^2)``: the scale of its
    rounding error. (The gradient's own norm equals it on average over random data, but
    a few dot products, as with one token, can cancel to far less.)"""
    ys, _, src_tok = _routed_rows(x, topk_ids, w_gate_up, w_down, activation, b_gate_up, b_down, transposed,
                                  interleaved, alpha, limit)
    return (grad_out.index_select(0, src_tok).to(ys.dtype) * ys).norm()


def reference_moe_fp8(x, topk_ids, topk_weights, w_gate_up, w_down, activation="swiglu", *, h_dtype=None,
                      w_gate_up_scale=None, w_down_scale=None, **kwargs):
    """``reference_moe`` in the FP8 recipe: x in 1 x 128 tiles, both weights in 128 x 128
    blocks and act(h) in 1 x 128 tiles before the down GEMM, each quantized to e4m3 and
    dequantized (the formats of ``moeblaze_ops.fp8``, tested on their own) so that every
    GEMM multiplies the quantized values, in float64 for float64 inputs: the math an FP8
    kernel computes, summed exactly. ``h_dtype``: h and act(h) rounded to it before their
    next step, as kernels that write them in that dtype round them (None: not rounded).
    ``w_gate_up_scale``, ``w_down_scale``: the weights are e4m3 already, with these block
    scales (a checkpoint's), and are dequantized with them in float64. ``kwargs`` are
    ``reference_moe``'s (biases, layout, ``alpha``, ``limit``); every width must be a
    multiple of 128."""
    from . import fp8

    def through_e4m3(t, quantize, dequantize):
        return dequantize(*quantize(t), t.dtype)

    if w_gate_up_scale is not None:
        w_gate_up, w_down = (fp8.dequantize_blocks(w, s, torch.float64)
                             for w, s in ((w_gate_up, w_gate_up_scale), (w_down, w_down_scale)))
    else:
        w_gate_up, w_down = (through_e4m3(w, fp8.quantize_blocks, fp8.dequantize_blocks) for w in (w_gate_up, w_down))
    ys, order, src_tok = _routed_rows(
        through_e4m3(x, fp8.quantize_rows, fp8.dequantize_rows), topk_ids, w_gate_up, w_down, activation,
        kwargs.get("b_gate_up"), kwargs.get("b_down"), kwargs.get("transposed", False),
        kwargs.get("interleaved", False), kwargs.get("alpha", CLAMPED_SWIGLU_ALPHA),
        kwargs.get("limit", CLAMPED_SWIGLU_LIMIT),
        round_h=None if h_dtype is None else (lambda h: h.to(h_dtype).to(h.dtype)),
        round_activated=lambda a: through_e4m3(a if h_dtype is None else a.to(h_dtype).to(a.dtype),
                                               fp8.quantize_rows, fp8.dequantize_rows))
    ys = ys * topk_weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
    return torch.zeros_like(x).index_add(0, src_tok, ys)


def _routed_rows(x, topk_ids, w_gate_up, w_down, activation, b_gate_up, b_down, transposed, interleaved, alpha,
                 limit, round_h=None, round_activated=None):
    """Each real routed row's expert output (unweighted), in expert order, with the
    (token, k) position it came from and its token; ``round_h`` and ``round_activated``,
    where given, map h (bias added) and act(h) before the next step uses them."""
    E = w_gate_up.shape[0]
    K = topk_ids.shape[1]
    flat_e = topk_ids.reshape(-1).long()
    order = flat_e.argsort(stable=True)
    counts = torch.bincount(flat_e.clamp(max=E), minlength=E + 1)[:E]
    real = int(counts.sum())
    order = order[:real]  # sentinels sort last
    src_tok = order // K
    xs = x.index_select(0, src_tok)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        chunk = xs[start:start + n]
        start += n
        w1 = w_gate_up[e] if transposed else w_gate_up[e].t()
        hidden = chunk @ w1
        if b_gate_up is not None:
            hidden = hidden + b_gate_up[e]
        if round_h is not None:
            hidden = round_h(hidden)
        a = reference_activation(hidden, activation, interleaved, alpha, limit)
        if round_activated is not None:
            a = round_activated(a)
        w2 = w_down[e] if transposed else w_down[e].t()
        y = a @ w2
        if b_down is not None:
            y = y + b_down[e]
        outs.append(y)
    ys = torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])
    return ys, order, src_tok
