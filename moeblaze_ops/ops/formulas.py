"""The autograd formulas of the expert ops, each written once.

``up_backward``, ``down_backward`` and ``recomputed_backward`` are the math; they call
the backward ops through the dispatcher, with ``validate=False`` (their arguments are a
checked forward's). They are registered on the forward ops
(``torch.library.register_autograd``: direct callers, ``opcheck``, traced graphs), and
run by ``UpProjection`` and ``DownProjection``, eager ``moe_experts``'s nodes. The
backward ops have no formula: where autograd records them, their outputs refuse a second
differentiation (``_refusing_autograd_kernel``).

A formula sees ``ctx.needs_input_grad`` only for the arguments the call passed (the
dispatcher drops trailing arguments equal to their defaults): ``_needs`` pads it.
"""

from __future__ import annotations

import contextlib

import torch

from ..activations import is_gated
from . import LIB, experts  # noqa: F401  (experts defines the ops the formulas are registered on)

_ops = torch.ops.moeblaze


class _NoGradientsOfGradients(torch.autograd.Function):
    """Passes a backward op's outputs through where autograd records them (a backward that
    builds a graph, ``create_graph``, or a direct call on tensors that require grad);
    differentiating them raises."""

    @staticmethod
    def forward(ctx, name, anchor, *outputs):
        ctx.name = name
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(f"moeblaze.{ctx.name}: gradients of gradients (double backward, e.g. "
                                  "gradgradcheck or create_graph=True followed by another backward) are not supported")


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def _refusing_autograd_kernel(name):
    """The autograd kernel of backward op ``name``: the op itself, its outputs marked so
    that a second differentiation raises where autograd records them. Leaner than a
    registered formula's wrapper, which compiled backward graphs would pay on every call
    for a refusal."""
    op = getattr(_ops, name).default

    def kernel(keyset, *args):
        with torch._C._AutoDispatchBelowAutograd():
            outputs = op.redispatch(keyset & _AFTER_AUTOGRAD, *args)
        if not torch.is_grad_enabled():
            return outputs
        anchor = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
        return outputs if anchor is None else _NoGradientsOfGradients.apply(name, anchor, *outputs)

    return kernel


def _needs(ctx, count: int) -> tuple:
    """``ctx.needs_input_grad`` padded to ``count`` flags (arguments left at their
    defaults need no gradient)."""
    need = tuple(ctx.needs_input_grad)
    return need + (False,) * (count - len(need))


# --------------------------------------------------------------------------- the math


def up_backward(grad_h, x, w_gate_up, eti, offsets, tim, has_bias, transposed, need_x, need_w, need_b):
    """``(grad_x, grad_w_gate_up, grad_b_gate_up)`` of the up projection, None where not needed."""
    if not (need_x or need_w or (has_bias and need_b)):
        return None, None, None
    grad_x, grad_w, grad_b = _ops.expert_up_backward.default(grad_h, x, w_gate_up, eti, offsets, tim, has_bias,
                                                             transposed, need_x, need_w or (has_bias and need_b), False)
    return grad_x if need_x else None, grad_w if need_w else None, grad_b if has_bias and need_b else None


def down_backward(grad_out, h, w_down, b_down, topk_weights, eti, offsets, tim, args, need_h, need_w, need_b,
                  need_tw, in_place=False):
    """``(grad_h, grad_w_down, grad_b_down, grad_topk_weights)`` of the down projection
    (``args``: activation, transposed, interleaved, alpha, limit), None where not needed;
    ``in_place`` writes grad_h over h (then returned as grad_h)."""
    has_b = b_down is not None
    need_wb = need_w or (has_b and need_b)
    if in_place:  # (never in a backward that builds a graph: DownProjection decides)
        grad_w, grad_b, grad_tw = _ops.expert_down_backward_.default(grad_out, h, w_down, eti, offsets, tim,
                                                                     topk_weights, b_down, *args, need_wb, False)
        grad_h = h
    else:
        grad_h, grad_w, grad_b, grad_tw = _ops.expert_down_backward.default(
            grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, *args, need_wb, False)
    return (grad_h if need_h else None, grad_w if need_w else None, grad_b if has_b and need_b else None,
            grad_tw if need_tw else None)


def recomputed_backward(grad_out, x, w_gate_up, w_down, b_gate_up, b_down, topk_weights, eti, offsets, tim, args,
                        need):
    """The backward of a layer that kept no h: h recomputed and dH written over it, then
    the up projection's gradients. ``need`` and the result: ``(x, w_gate_up, w_down,
    b_gate_up, b_down, topk_weights)``, None where not needed."""
    need_x, need_wgu, need_wd, need_bgu, need_bd, need_tw = need
    has_bgu, has_bd = b_gate_up is not None, b_down is not None
    grad_h, grad_wd, grad_bd, grad_tw = _ops.expert_down_backward_recompute.default(
        grad_out, x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up,
        b_down, *args, need_wd or (has_bd and need_bd), False)
    grad_x, grad_wgu, grad_bgu = up_backward(grad_h, x, w_gate_up, eti, offsets, tim, has_bgu, args[1], need_x,
                                             need_wgu, need_bgu)
    return (grad_x, grad_wgu, grad_wd if need_wd else None, grad_bgu, grad_bd if has_bd and need_bd else None,
            grad_tw if need_tw else None)


# --------------------------------------------------------------------------- registered on the ops


def _up_setup_context(ctx, inputs, output):
    x, w_gate_up, eti, offsets, tim, b_gate_up, transposed, *_ = inputs
    ctx.save_for_backward(x, w_gate_up, eti, offsets, tim)
    ctx.has_bias, ctx.transposed = b_gate_up is not None, transposed


def _up_formula(ctx, grad_h):
    x, w_gate_up, eti, offsets, tim = ctx.saved_tensors
    need = _needs(ctx, 8)  # x, w_gate_up, eti, offsets, tim, b_gate_up, transposed, validate
    grad_x, grad_w, grad_b = up_backward(grad_h, x, w_gate_up, eti, offsets, tim, ctx.has_bias, ctx.transposed,
                                         need[0], need[1], need[5])
    return grad_x, grad_w, None, None, None, grad_b, None, None


def _up_beside_setup_context(ctx, inputs, output):
    _up_setup_context(ctx, inputs, output)
    ctx.mark_non_differentiable(output[1])  # act(h): the down projection differentiates through h
    ctx.set_materialize_grads(False)  # else a zero-filled [L*K, I] gradient for act(h)


def _up_beside_formula(ctx, grad_h, grad_a):
    if grad_h is None:
        return (None,) * 11
    return (*_up_formula(ctx, grad_h)[:7], None, None, None, None)


def _down_setup_context(ctx, inputs, output):
    h, w_down, eti, offsets, tim, topk_weights, b_down, *args = inputs
    ctx.save_for_backward(h, w_down, b_down, topk_weights, eti, offsets, tim)
    ctx.args = tuple(args[:5])  # activation, transposed, interleaved, alpha, limit


def _down_formula(ctx, grad_out):
    h, w_down, b_down, topk_weights, eti, offsets, tim = ctx.saved_tensors
    need = _needs(ctx, 13)  # h, w_down, eti, offsets, tim, topk_weights, b_down, activation..limit, validate
    grad_h, grad_w, grad_b, grad_tw = down_backward(grad_out, h, w_down, b_down, topk_weights, eti, offsets, tim,
                                                    ctx.args, need[0], need[1], need[6], need[5])
    return (grad_h, grad_w, None, None, None, grad_tw, grad_b) + (None,) * 6


def _layer_setup_context(ctx, inputs, output):
    x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down, *args = inputs
    ctx.fp8 = len(args) > 6 and args[6] is not None  # args: activation..limit, validate, the two scales
    ctx.save_for_backward(*(() if ctx.fp8 else (x, w_gate_up, w_down, b_gate_up, b_down, topk_weights, eti, offsets,
                                                 tim)))
    ctx.args = tuple(args[:5])  # activation, transposed, interleaved, alpha, limit


def _layer_formula(ctx, grad_out):
    if ctx.fp8:
        raise NotImplementedError("moeblaze.expert_layer: FP8 weights (scales given) have no backward yet: run the "
                                  "FP8 layer without gradients (torch.no_grad(), torch.inference_mode()), or "
                                  "differentiate the layer in bf16")
    x, w_gate_up, w_down, b_gate_up, b_down, topk_weights, eti, offsets, tim = ctx.saved_tensors
    need = _needs(ctx, 17)  # x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down, ...
    grad_x, grad_wgu, grad_wd, grad_bgu, grad_bd, grad_tw = recomputed_backward(
        grad_out, x, w_gate_up, w_down, b_gate_up, b_down, topk_weights, eti, offsets, tim, ctx.args,
        (need[0], need[1], need[2], need[7], need[8], need[6]))
    return (grad_x, grad_wgu, grad_wd, None, None, None, grad_tw, grad_bgu, grad_bd) + (None,) * 8


for _name, _formula, _setup in (("expert_up", _up_formula, _up_setup_context),
                                ("_expert_up_beside", _up_beside_formula, _up_beside_setup_context),
                                ("expert_down", _down_formula, _down_setup_context),
                                ("expert_layer", _layer_formula, _layer_setup_context)):
    torch.library.register_autograd(f"moeblaze::{_name}", _formula, setup_context=_setup)
for _name in ("expert_up_backward", "expert_down_backward", "expert_down_backward_", "expert_down_backward_recompute"):
    LIB.impl(_name, _refusing_autograd_kernel(_name), "Autograd", with_keyset=True)


# --------------------------------------------------------------------------- moe_experts' eager nodes
#
# Eager ``moe_experts`` applies these two nodes instead of the ops' registered formulas:
# the same ops and the same math, with what an op's formula cannot know (that h is the
# layer's own, so dH may overwrite it; that act(h) comes beside h), and without the
# registered formulas' Python wrappers, whose host time small layers pay every step
# (docs/performance.md). Two nodes, not one: the engine accumulates the down weights'
# gradient before the up projection's backward allocates its own.


class UpProjection(torch.autograd.Function):
    """``moe_experts``'s up projection: ``(h, a)``, where ``beside`` asks for it a = act(h)
    from the same GEMM (``_expert_up_beside``; not differentiable: the down projection
    differentiates through h), else ``expert_up``'s h and None. Backward: ``up_backward``."""

    @staticmethod
    def forward(ctx, x, w_gate_up, b_gate_up, eti, offsets, tim, args, beside):
        ctx.save_for_backward(x, w_gate_up, eti, offsets, tim)
        ctx.has_bias, ctx.transposed = b_gate_up is not None, args[1]
        ctx.set_materialize_grads(False)  # else a zero-filled [L*K, I] gradient for act(h)
        activation, transposed, interleaved, alpha, limit = args
        with torch._C._AutoDispatchBelowAutograd():
            if not beside:
                return _ops.expert_up.default(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed, False), None
            h, a = _ops._expert_up_beside.default(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed, activation,
                                                  interleaved, alpha, limit)
        ctx.mark_non_differentiable(a)
        return h, a

    @staticmethod
    def backward(ctx, grad_h, grad_a):
        if grad_h is None:  # nothing reached h
            return (None,) * 8
        x, w_gate_up, eti, offsets, tim = ctx.saved_tensors
        need = ctx.needs_input_grad  # x, w_gate_up, b_gate_up, ...
        return (*up_backward(grad_h, x, w_gate_up, eti, offsets, tim, ctx.has_bias, ctx.transposed, need[0],
                             need[1], need[2]), None, None, None, None, None)


class DownProjection(torch.autograd.Function):
    """``moe_experts``'s down projection of its own h: ``expert_down`` (or, given ``a`` =
    act(h) from ``_expert_up_beside``, ``_expert_down_activated``), whose backward is
    ``down_backward``. Where ``up`` is given (eager autograd: the up projection's x,
    w_gate_up and b_gate_up), backward writes dH over h, the layer's own tensor: h and dH
    never exist at once. A second backward through the same graph (``retain_graph=True``)
    finds h overwritten and recomputes it from ``up``: one more GEMM for the rare second
    pass, nothing more kept for the first.
    """

    @staticmethod
    def forward(ctx, h, a, w_down, b_down, topk_weights, eti, offsets, tim, args, up):
        ctx.save_for_backward(h, w_down, b_down, topk_weights, eti, offsets, tim)
        ctx.args, ctx.up, ctx.overwritten = args, up, False
        with torch._C._AutoDispatchBelowAutograd():
            if a is not None:
                return _ops._expert_down_activated.default(a, w_down, eti, offsets, tim, topk_weights, b_down,
                                                           args[1], is_gated(args[0]))
            return _ops.expert_down.default(h, w_down, eti, offsets, tim, topk_weights, b_down, *args, False)

    @staticmethod
    def backward(ctx, grad_out):
        h, w_down, b_down, topk_weights, eti, offsets, tim = ctx.saved_tensors
        need = ctx.needs_input_grad  # h, a, w_down, b_down, topk_weights, ...
        # A backward that builds a graph (create_graph) runs out of place, and the backward
        # ops refuse the second differentiation clearly.
        in_place = ctx.up is not None and not torch.is_grad_enabled()
        if in_place and ctx.overwritten:  # a second backward: the saved h holds the first one's dH
            x, w_gate_up, b_gate_up = ctx.up
            with torch._C._AutoDispatchBelowAutograd():
                h = _ops.expert_up.default(x, w_gate_up, eti, offsets, tim, b_gate_up, ctx.args[1], False)
        # The write over h is deliberate and tracked (``overwritten``), so h keeps its
        # version: a second backward may unpack it, and then recomputes it.
        with torch.autograd._unsafe_preserve_version_counter(h) if in_place else contextlib.nullcontext():
            grad_h, grad_w, grad_b, grad_tw = down_backward(grad_out, h, w_down, b_down, topk_weights, eti, offsets,
                                                            tim, ctx.args, need[0], need[2], need[3], need[4],
                                                            in_place)
        ctx.overwritten = ctx.overwritten or in_place
        return grad_h, None, grad_w, grad_b, grad_tw, None, None, None, None, None
