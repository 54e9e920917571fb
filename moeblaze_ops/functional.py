"""``moe_experts``: the experts of an MoE layer in one call, composed of the moeblaze ops."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .activations import clamped_swiglu_defaults
from .checks import check_moe_experts


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
            still works: it recomputes h (one more GEMM). Compiled graphs keep the two
            apart (Inductor would copy h before writing over it).

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
    E, _, d = check_moe_experts(x2, ids, tw, w_gate_up, w_down, b_gate_up, b_down, activation, transposed)
    ops = torch.ops.moeblaze
    eti, offsets, tim = ops.dispatch(ids, E)
    # alpha and limit are clamped_swiglu's alone, and default to None rather than to floats:
    # torch.compile makes a float argument of the function it compiles a symbol, then
    # restarts its analysis to specialise it. Constants keep the graph free of them.
    default_alpha, default_limit = clamped_swiglu_defaults()
    if activation != "clamped_swiglu" or alpha is None:
        alpha = default_alpha
    if activation != "clamped_swiglu" or limit is None:
        limit = default_limit
    args = (activation, transposed, interleaved, alpha, limit)
    if recompute:
        out = _RecomputedExperts.apply(x2, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim, args)
    else:
        h = ops.expert_up(x2, w_gate_up, eti, offsets, tim, b_gate_up, transposed)
        # Under torch.compile Inductor would copy h before a declared in-place write.
        if overwrite_h and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            out = _OverwritingDown.apply(h, w_down, b_down, tw, eti, offsets, tim, args,
                                         (x2, w_gate_up, b_gate_up, transposed))
        else:
            out = ops.expert_down(h, w_down, eti, offsets, tim, tw, b_down, *args)
    return out.reshape(*lead, d)


class _RecomputedExperts(torch.autograd.Function):
    """expert_up + expert_down whose backward recomputes h instead of keeping it."""

    @staticmethod
    def forward(x, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim, args):
        activation, transposed, interleaved, alpha, limit = args
        ops = torch.ops.moeblaze
        h = ops.expert_up(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed)
        return ops.expert_down(h, w_down, eti, offsets, tim, tw, b_down, activation, transposed, interleaved,
                               alpha, limit)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim, args = inputs
        ctx.save_for_backward(x, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim)
        ctx.args = args

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim = ctx.saved_tensors
        activation, transposed, interleaved, alpha, limit = ctx.args
        ops = torch.ops.moeblaze
        need = ctx.needs_input_grad  # x, w_gate_up, w_down, b_gate_up, b_down, tw, ...
        has_bgu, has_bd = b_gate_up is not None, b_down is not None
        # One op recomputes h and writes dH over it (see its docstring for why one op).
        grad_h, grad_w_down, grad_b_down, grad_tw = ops.expert_down_backward_recompute(
            grad_out, x, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, activation, transposed,
            interleaved, alpha, limit, need[2] or (has_bd and need[4]))
        need_x, need_wgu = need[0], need[1] or (has_bgu and need[3])
        grad_x = grad_w_gate_up = grad_b_gate_up = None
        if need_x or need_wgu:
            grad_x, grad_w_gate_up, grad_b_gate_up = ops.expert_up_backward(
                grad_h, x, w_gate_up, eti, offsets, tim, has_bgu, transposed, need_x, need_wgu)
        keep = lambda g, i, present=True: g if present and need[i] else None  # noqa: E731
        return (keep(grad_x, 0), keep(grad_w_gate_up, 1), keep(grad_w_down, 2), keep(grad_b_gate_up, 3, has_bgu),
                keep(grad_b_down, 4, has_bd), keep(grad_tw, 5), None, None, None, None)


class _OverwritingDown(torch.autograd.Function):
    """expert_down whose backward writes dH over the h it kept (plain eager autograd, where
    h is the layer's own): the gradient for h is h itself, afterwards.

    A second backward through the same graph (``retain_graph=True``) finds h overwritten
    and recomputes it from ``up`` (the up projection's inputs, which its own autograd node
    keeps anyway): one more GEMM for the rare second pass, nothing more kept for the first.
    """

    @staticmethod
    def forward(ctx, h, w_down, b_down, tw, eti, offsets, tim, args, up):
        ctx.save_for_backward(h, w_down, b_down, tw, eti, offsets, tim)
        ctx.args = args
        ctx.up = up
        ctx.overwritten = False
        return torch.ops.moeblaze.expert_down(h, w_down, eti, offsets, tim, tw, b_down, *args)

    @staticmethod
    def backward(ctx, grad_out):
        h, w_down, b_down, tw, eti, offsets, tim = ctx.saved_tensors
        ops = torch.ops.moeblaze
        if ctx.overwritten:  # a second backward: the saved h holds the first one's dH
            x, w_gate_up, b_gate_up, transposed = ctx.up
            with torch.no_grad():
                h = ops.expert_up(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed)
        need = ctx.needs_input_grad  # h, w_down, b_down, tw, ...
        has_b = b_down is not None
        need_w = need[1] or (has_b and need[2])
        if torch.is_grad_enabled():
            # create_graph: the functional op, whose autograd says that double backward is unsupported.
            grad_h, grad_w, grad_b, grad_tw = ops.expert_down_backward(
                grad_out, h, w_down, eti, offsets, tim, tw, b_down, *ctx.args, need_w)
        else:
            # The write over h is deliberate and this Function tracks it (``overwritten``), so
            # h keeps its version: a second backward may unpack it, and then recomputes it.
            with torch.autograd._unsafe_preserve_version_counter(h):
                grad_w, grad_b, grad_tw = ops.expert_down_backward_(
                    grad_out, h, w_down, eti, offsets, tim, tw, b_down, *ctx.args, need_w)
            grad_h = h
            ctx.overwritten = True
        return (grad_h if need[0] else None, grad_w if need[1] else None, grad_b if has_b and need[2] else None,
                grad_tw if need[3] else None, None, None, None, None, None)
