"""``moe_experts``: the experts of an MoE layer in one call, made of the moeblaze ops.

One route in every mode (eager, ``torch.compile``, ``torch.export``, tensor subclasses
and modes): ``dispatch``, then

- ``expert_layer`` where no h is needed after the forward (nothing to differentiate, or
  ``recompute=True``, whose backward recomputes h);
- else ``expert_up`` and ``expert_down``, h kept for backward. Traced, the graph records
  the two ops with their registered formulas; in eager autograd they run inside
  ``ops.formulas.UpProjection`` and ``DownProjection``, whose backward is the same
  formula code, writing dH over the layer's own h. In eager, where
  ``kernels.config.activation_beside_h`` says so, the up GEMM writes act(h) beside h
  (``_expert_up_beside``) and the down GEMM reads it; compiled graphs make the same
  choice in their lowering (``lowerings/expert_ops.py``).

Every step is a ``torch.ops.moeblaze`` op, seen by modes, subclasses and Dynamo alike,
and every gradient comes from the formulas in ``ops/formulas.py``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from .activations import clamped_swiglu_defaults, is_gated
from .checks import check_moe_experts
from .kernels import config
from .layouts import linear_dims
from .ops.formulas import DownProjection, UpProjection


def moe_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str = "swiglu",
    *,
    b_gate_up: Optional[Tensor] = None,
    b_down: Optional[Tensor] = None,
    transposed: bool = False,
    interleaved: bool = False,
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
    recompute: bool = False,
    overwrite_h: bool = True,
    precision: str = "default",
    w_gate_up_scale: Optional[Tensor] = None,
    w_down_scale: Optional[Tensor] = None,
) -> Tensor:
    """Runs every token through its K experts and sums the results with their weights.

    ``out[i] = sum_k topk_weights[i, k] * expert_{topk_ids[i, k]}(x[i])`` where an expert
    is ``down(activation(up(x)))``. Differentiable in ``x``, the weights, the biases and
    ``topk_weights``; works under ``torch.compile(fullgraph=True)``.

    Args:
        x: ``[..., d]`` tokens (bf16, fp16, fp32 or fp64); the output has this shape and dtype.
        topk_ids: ``[..., K]`` int32/int64 expert ids. Ids ``>= E`` are sentinels that
            contribute nothing (expert parallelism); negative or repeated ids are errors.
        topk_weights: ``[..., K]`` combine weights, any float dtype (fp32 with bf16 x is fine).
        w_gate_up: ``[E, N, d]``, or ``[E, d, N]`` when ``transposed``. N = 2I for the gated
            activations (gate columns then up columns, or alternating when
            ``interleaved``), N = I otherwise. HF's ``gate_up_proj``.
        w_down: ``[E, d, I]``, or ``[E, I, d]`` when ``transposed``. HF's ``down_proj``.
        activation: one of ``moeblaze_ops.ACTIVATIONS``: ``swiglu``, ``geglu``,
            ``clamped_swiglu`` (GPT-OSS, uses ``alpha`` and ``limit``), ``silu``,
            ``gelu``, ``relu``.
        b_gate_up: optional ``[E, N]`` per-expert bias of the up projection.
        b_down: optional ``[E, d]`` per-expert bias of the down projection.
        alpha, limit: ``clamped_swiglu``'s parameters; None (the default) means GPT-OSS's
            1.702 and 7.0. The other activations ignore them.
        recompute: keep only x, the index arrays and topk_weights for backward, and
            recompute h there with one more up-projection GEMM, writing dH over it (for
            the longest sequences: neither the saved h nor a second [L*K, N] buffer in
            backward). By default backward keeps h as well.
        overwrite_h: in eager autograd, let backward write dH over the h it kept rather
            than into a second [L*K, N] tensor (the same memory saving for the default
            mode). A second backward through the same graph (``retain_graph=True``)
            still works: it recomputes h (one more GEMM). Compiled graphs decide for
            themselves: Inductor's lowering writes dH over h where AOTAutograd donated
            h to the backward.

        precision: ``"default"`` (the GEMMs in the inputs' dtype) or ``"fp8"``: the FP8
            recipe of DeepSeek-V3 (``moeblaze_ops.fp8``): x's rows and act(h)'s in 1 x 128
            e4m3 tiles, the weights in 128 x 128 e4m3 blocks, fp32 scales applied per
            128-wide block of each GEMM's reduction, h and the output in x's dtype. With
            weights of x's dtype, ``"fp8"`` quantizes them in the call (a pass over them
            each call: quantize once and pass the e4m3 weights where they do not change).
            No gradients yet: a backward through an FP8 layer raises ``NotImplementedError``,
            and so does compiling one with gradients on (AOTAutograd traces the backward
            with the forward): compile it under ``torch.no_grad()`` or ``inference_mode``.
        w_gate_up_scale, w_down_scale: FP8 weights: ``w_gate_up`` and ``w_down`` are e4m3
            (``torch.float8_e4m3fn``) and these are the float32 scales of their 128 x 128
            blocks in the weight's layout (``moeblaze_ops.fp8.quantize_blocks``; a
            fine-grained FP8 checkpoint's ``weight_scale_inv``): the layer runs in FP8
            (whatever ``precision`` says), and no bf16 copy of the weights is made. Every
            width must be a multiple of 128.

    With nothing to differentiate (``torch.no_grad()``, inference), and in
    ``recompute=True``'s forward, no h is made: the layer runs as the op
    ``expert_layer``, whose up GEMM writes act(h) for the down GEMM to read.

    Not supported, with a clear error: ``torch.func`` transforms (``grad``, ``vmap``,
    ``jacrev``, ...; torch's custom-op autograd does not run under them: use
    ``torch.autograd.grad`` or ``.backward()``, and put a batch in the leading dimensions
    of ``x``) and gradients of gradients (double backward).
    """
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            "moeblaze.moe_experts does not support torch.func transforms (grad, vmap, jacrev, ...): torch runs "
            "the autograd of custom ops only outside them. Use torch.autograd.grad or .backward() for gradients, "
            "and the leading dimensions of x ([..., d]) for a batch.")
    for arg, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, Tensor) or t.dim() == 0:
            raise ValueError(f"moeblaze.moe_experts: argument '{arg}' must be a Tensor with at least one dimension")
    lead = x.shape[:-1]
    if topk_ids.dim() != x.dim() or any(a != b for a, b in zip(topk_ids.shape[:-1], lead)):
        raise ValueError(f"moeblaze.moe_experts: argument 'topk_ids' must have shape [..., K] with leading "
                         f"dimensions {tuple(lead)} of x, got {tuple(topk_ids.shape)}")
    if topk_weights.dim() != topk_ids.dim() or any(a != b for a, b in zip(topk_weights.shape, topk_ids.shape)):
        raise ValueError(f"moeblaze.moe_experts: argument 'topk_weights' must have the shape of topk_ids "
                         f"{tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    x2, ids, tw = x, topk_ids, topk_weights
    if x.dim() > 2:  # flatten leading dimensions: [..., d] -> [L, d]
        x2, ids, tw = x.flatten(0, -2), topk_ids.flatten(0, -2), topk_weights.flatten(0, -2)
    scales = _fp8_weights(x2, tw, w_gate_up, w_down, b_gate_up, b_down, transposed, precision, w_gate_up_scale,
                          w_down_scale)
    if scales is not None:
        (w_gate_up, w_gate_up_scale), (w_down, w_down_scale) = scales
    # The cross-argument checks on the weights' shapes (FP8 weights were checked above).
    w_checked = [w if scales is None else x2.new_empty(1).expand(w.shape) for w in (w_gate_up, w_down)]
    E, _, d = check_moe_experts(x2, ids, tw, *w_checked, b_gate_up, b_down, activation, transposed)
    # alpha and limit are clamped_swiglu's alone, and default to None rather than to floats:
    # torch.compile makes a float argument of the function it compiles a symbol, then
    # restarts its analysis to specialise it. Constants keep the graph free of them.
    default_alpha, default_limit = clamped_swiglu_defaults()
    if activation != "clamped_swiglu" or alpha is None:
        alpha = default_alpha
    if activation != "clamped_swiglu" or limit is None:
        limit = default_limit
    args = (activation, transposed, interleaved, alpha, limit)
    ops = torch.ops.moeblaze
    # The arguments were checked above and the layer's own dispatch makes the index arrays:
    # the ops check nothing again (validate=False), which small layers would pay every step.
    eti, offsets, tim = ops.dispatch(ids, E)
    differentiates = _differentiates(x2, w_gate_up, w_down, b_gate_up, b_down, tw)
    if scales is not None:
        # Recorded where gradients are on, so that only a backward through it raises (the
        # formula's): a forward with gradients on (evaluation without torch.no_grad) runs.
        unrecorded = not differentiates and not torch.compiler.is_compiling()
        with torch._C._AutoDispatchBelowAutograd() if unrecorded else contextlib.nullcontext():
            out = ops.expert_layer.default(x2, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, *args,
                                           False, w_gate_up_scale, w_down_scale)
    elif recompute or not differentiates:
        # With nothing to record, eager calls go past the op's autograd kernel (its
        # formula's wrapper, host time).
        unrecorded = not differentiates and not torch.compiler.is_compiling()
        with torch._C._AutoDispatchBelowAutograd() if unrecorded else contextlib.nullcontext():
            out = ops.expert_layer.default(x2, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, *args,
                                           False)
    elif torch.compiler.is_compiling():
        # The ops and their registered formulas (the same math): a traced graph records
        # expert_up and expert_down themselves, and the lowerings choose act(h) beside h and
        # write dH over h where AOTAutograd donated it to the backward.
        h = ops.expert_up(x2, w_gate_up, eti, offsets, tim, b_gate_up, transposed, False)
        out = ops.expert_down(h, w_down, eti, offsets, tim, tw, b_down, *args, False)
    else:
        beside = is_gated(activation) and config.activation_beside_h(
            linear_dims(w_gate_up, transposed)[1] // 2, eti.shape[0], E, interleaved=interleaved,
            up_bias=b_gate_up is not None)
        h, a = UpProjection.apply(x2, w_gate_up, b_gate_up, eti, offsets, tim, args, beside)
        # Eager autograd may write dH over h, the layer's own.
        up = (x2, w_gate_up, b_gate_up) if overwrite_h else None
        out = DownProjection.apply(h, a, w_down, b_down, tw, eti, offsets, tim, args, up)
    return out.reshape(*lead, d)


#: ``moe_experts``' ``precision`` values.
PRECISIONS = ("default", "fp8")


def _fp8_weights(x, topk_weights, w_gate_up, w_down, b_gate_up, b_down, transposed, precision, w_gate_up_scale,
                 w_down_scale):
    """``((w_gate_up, its scales), (w_down, its scales))`` in e4m3 where the layer runs in
    FP8 (scales given, e4m3 weights, or ``precision="fp8"``, which quantizes weights of x's
    dtype here), checked; None where it does not."""
    from . import fp8
    from .checks import check_fp8_weights

    if precision not in PRECISIONS:
        raise ValueError(f"moeblaze.moe_experts: argument 'precision' must be one of {PRECISIONS}, got {precision!r}")
    given = w_gate_up_scale is not None or w_down_scale is not None or fp8.E4M3 in (w_gate_up.dtype, w_down.dtype)
    if not given and precision != "fp8":
        return None
    if not given:
        for arg, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
            if w.dtype != x.dtype:
                raise ValueError(f"moeblaze.moe_experts: argument '{arg}' must have the dtype of 'x' ({x.dtype}) to "
                                 f"be quantized for precision='fp8', got {w.dtype}")
            for n in w.shape[1:]:
                fp8.check_blocked_width(f"{arg}'s dimension", n)
        (w_gate_up, w_gate_up_scale), (w_down, w_down_scale) = fp8.quantize_blocks(w_gate_up), fp8.quantize_blocks(
            w_down)
    check_fp8_weights("moe_experts", x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, transposed)
    return (w_gate_up, w_gate_up_scale), (w_down, w_down_scale)


def _differentiates(*tensors) -> bool:
    """Whether autograd would record a graph through any of ``tensors``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

