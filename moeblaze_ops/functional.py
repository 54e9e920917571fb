"""``moe_experts``: the experts of an MoE layer in one call, composed of the moeblaze ops.

Three routes run the same kernels:

- traced (``torch.compile``, ``torch.export``): the ops and their autograd formulas,
  which Inductor lowers to templates (``moeblaze_ops.lowerings``);
- eager, plain CPU/CUDA tensors and no active mode: autograd nodes of this module
  (``_UpNode`` and ``_DownNode``, or ``_RecomputedLayer``) that call the backend's kernels
  directly (``_KernelCalls``): no dispatcher round trip per step, and no value check of
  the index arrays the layer's own ``dispatch`` made;
- eager otherwise (tensor subclasses, torch function or dispatch modes, other devices):
  the same nodes calling the ops (``_OpCalls``), which those see.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from .activations import clamped_swiglu_defaults, is_gated
from .checks import check_moe_experts
from .kernels import backward_backend, forward_backend
from .ops.experts import layer_kernels


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
            still works: it recomputes h (one more GEMM). Compiled graphs decide for
            themselves: Inductor's lowering writes dH over h where AOTAutograd donated
            h to the backward.

    With a gated activation and nothing to differentiate (``torch.no_grad()``, inference),
    and in ``recompute=True``'s forward, no h is made: the layer runs as the op
    ``expert_layer``, whose up GEMM writes act(h) for the down GEMM to read
    (``settings.up_epilogue_activation``).

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
    # alpha and limit are clamped_swiglu's alone, and default to None rather than to floats:
    # torch.compile makes a float argument of the function it compiles a symbol, then
    # restarts its analysis to specialise it. Constants keep the graph free of them.
    default_alpha, default_limit = clamped_swiglu_defaults()
    if activation != "clamped_swiglu" or alpha is None:
        alpha = default_alpha
    if activation != "clamped_swiglu" or limit is None:
        limit = default_limit
    args = (activation, transposed, interleaved, alpha, limit)
    traced = torch.compiler.is_compiling()
    if traced:
        calls = _OP_CALLS  # the ops and their autograd formulas, which Inductor lowers (lowerings/)
    else:
        calls = _KERNEL_CALLS if _plain(x2, ids, tw, w_gate_up, w_down, b_gate_up, b_down) else _OP_CALLS
    eti, offsets, tim = calls.dispatch(ids, E)
    if is_gated(activation) and not _differentiates(x2, w_gate_up, w_down, b_gate_up, b_down, tw):
        # Nothing to differentiate: no h is needed after the forward, so none is made
        # (settings.up_epilogue_activation, read where the kernels run: a traced graph
        # must not read the settings). The up projection writes act(h), from its GEMM's
        # epilogue on Hopper, and the down projection reads it.
        out = calls.layer(x2, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, args)
    elif recompute:
        out = _RecomputedLayer.apply(x2, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim, args, calls)
    elif traced:
        # The ops' own formulas; Inductor's lowering writes dH over h where AOTAutograd
        # donated h to the backward, and has the up projection write act(h) beside h where
        # settings.activation_beside_h says so (lowerings/expert_ops.py).
        h = calls.up(x2, w_gate_up, eti, offsets, tim, b_gate_up, transposed)
        out = calls.down(h, w_down, eti, offsets, tim, tw, b_down, args)
    else:
        up = (x2, w_gate_up, b_gate_up) if overwrite_h else None
        # act(h) comes beside h where settings.activation_beside_h makes it (else None).
        h, a = _UpNode.apply(x2, w_gate_up, b_gate_up, eti, offsets, tim, args, calls)
        out = _DownNode.apply(h, w_down, b_down, tw, eti, offsets, tim, args, calls, up, a)
    return out.reshape(*lead, d)


def _differentiates(*tensors) -> bool:
    """Whether autograd would record a graph through any of ``tensors``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _plain(*tensors) -> bool:
    """Whether an eager call may run the kernels directly: CPU or CUDA tensors of plain
    types, and no torch function or dispatch mode active (subclasses such as DTensor and
    FakeTensor, and modes such as FlopCounterMode or selective checkpointing, must see the
    ops)."""
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False
    if tensors[0].device.type not in ("cpu", "cuda"):
        return False
    return all(t is None or type(t) is Tensor or type(t) is torch.nn.Parameter for t in tensors)


class _OpCalls:
    """The layer's steps as calls of the ``torch.ops.moeblaze`` ops: what modes, tensor
    subclasses and a second differentiation (``create_graph``) must see."""

    @staticmethod
    def dispatch(ids, E):
        return torch.ops.moeblaze.dispatch(ids, E)

    @staticmethod
    def up(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed):
        return torch.ops.moeblaze.expert_up(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed)

    @staticmethod
    def up_with_activation(x, w_gate_up, eti, offsets, tim, b_gate_up, args):
        return _OpCalls.up(x, w_gate_up, eti, offsets, tim, b_gate_up, args[1]), None  # the op makes h alone

    @staticmethod
    def down(h, w_down, eti, offsets, tim, tw, b_down, args):
        return torch.ops.moeblaze.expert_down(h, w_down, eti, offsets, tim, tw, b_down, *args)

    @staticmethod
    def layer(x, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, args):
        return torch.ops.moeblaze.expert_layer(x, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, *args)

    @staticmethod
    def down_backward(grad_out, h, w_down, eti, offsets, tim, tw, b_down, args, need_w, in_place):
        ops = torch.ops.moeblaze
        if not in_place:
            return ops.expert_down_backward(grad_out, h, w_down, eti, offsets, tim, tw, b_down, *args, need_w)
        return (h, *ops.expert_down_backward_(grad_out, h, w_down, eti, offsets, tim, tw, b_down, *args, need_w))

    @staticmethod
    def down_backward_recompute(grad_out, x, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, args,
                                need_w):
        # One op: under torch.compile the partitioner would merge a separate expert_up with
        # the forward's identical call and save h after all.
        return torch.ops.moeblaze.expert_down_backward_recompute(grad_out, x, w_gate_up, w_down, eti, offsets, tim,
                                                                 tw, b_gate_up, b_down, *args, need_w)

    @staticmethod
    def up_backward(grad_h, x, w_gate_up, eti, offsets, tim, has_bias, transposed, need_x, need_w):
        return torch.ops.moeblaze.expert_up_backward(grad_h, x, w_gate_up, eti, offsets, tim, has_bias, transposed,
                                                     need_x, need_w)


class _KernelCalls:
    """The same steps straight to the backend's kernels, for plain eager tensors: no trip
    through the dispatcher and the custom-op wrappers (tens of microseconds a call, which
    small layers pay on every step), and no check of index arrays: this layer's own
    ``dispatch`` made them. ``moe_experts`` checked every argument already. In a profile
    the steps carry the ops' names."""

    @staticmethod
    def dispatch(ids, E):
        with _profiled("moeblaze::dispatch"):
            return forward_backend(ids).dispatch(ids, E)

    @staticmethod
    def up(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed):
        with _profiled("moeblaze::expert_up"):
            return forward_backend(x).expert_up(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed)

    @staticmethod
    def up_with_activation(x, w_gate_up, eti, offsets, tim, b_gate_up, args):
        activation, transposed, interleaved, alpha, limit = args
        with _profiled("moeblaze::expert_up"):
            return forward_backend(x).expert_up_with_activation(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed,
                                                                activation, interleaved, alpha, limit)

    @staticmethod
    def down(h, w_down, eti, offsets, tim, tw, b_down, args):
        with _profiled("moeblaze::expert_down"):
            return forward_backend(h).expert_down(h, w_down, eti, offsets, tim, tw, b_down, *args)

    @staticmethod
    def down_activated(a, w_down, eti, offsets, tim, tw, b_down, transposed):
        # act(h) comes beside h for gated activations only.
        with _profiled("moeblaze::expert_down"):
            return forward_backend(a).expert_down_activated(a, w_down, eti, offsets, tim, tw, b_down, transposed,
                                                            gated=True)

    @staticmethod
    def layer(x, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, args):
        return layer_kernels(forward_backend(x), x, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down,
                             *args, profiled=_profiled)

    @staticmethod
    def down_backward(grad_out, h, w_down, eti, offsets, tim, tw, b_down, args, need_w, in_place):
        with _profiled("moeblaze::expert_down_backward"):
            return backward_backend(h).expert_down_backward(grad_out, h, w_down, eti, offsets, tim, tw, b_down,
                                                            *args, in_place=in_place, need_weight_grad=need_w)

    @staticmethod
    def down_backward_recompute(grad_out, x, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, args,
                                need_w):
        h = _KernelCalls.up(x, w_gate_up, eti, offsets, tim, b_gate_up, args[1])
        return _KernelCalls.down_backward(grad_out, h, w_down, eti, offsets, tim, tw, b_down, args, need_w, True)

    @staticmethod
    def up_backward(grad_h, x, w_gate_up, eti, offsets, tim, has_bias, transposed, need_x, need_w):
        with _profiled("moeblaze::expert_up_backward"):
            return backward_backend(x).expert_up_backward(grad_h, x, w_gate_up, eti, offsets, tim, has_bias,
                                                          transposed, need_x, need_w)


_OP_CALLS, _KERNEL_CALLS = _OpCalls(), _KernelCalls()


def _profiled(name):
    """A profiler range named ``name`` while a profiler runs, else nothing (a range costs
    an op call of its own)."""
    return torch.autograd.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else _NO_RANGE


_NO_RANGE = contextlib.nullcontext()


def _up_backward(calls, grad_h, x, w_gate_up, eti, offsets, tim, has_bgu, transposed, need_x, need_wgu, need_bgu):
    """``(grad_x, grad_w_gate_up, grad_b_gate_up)``, None where not needed."""
    if not (need_x or need_wgu or (has_bgu and need_bgu)):
        return None, None, None
    grad_x, grad_w, grad_b = calls.up_backward(grad_h, x, w_gate_up, eti, offsets, tim, has_bgu, transposed,
                                               need_x, need_wgu or (has_bgu and need_bgu))
    return grad_x if need_x else None, grad_w if need_wgu else None, grad_b if has_bgu and need_bgu else None


def _backward_calls(ctx):
    """A backward that builds a graph (``create_graph``) runs the ops, whose autograd
    refuses a second differentiation clearly."""
    return _OP_CALLS if torch.is_grad_enabled() else ctx.calls


class _UpNode(torch.autograd.Function):
    """``expert_up`` in eager autograd, through ``calls``: ``(h, a)``, a = act(h) where
    the backend makes it beside h (``settings.activation_beside_h``; not differentiable:
    the down projection's node differentiates through h), else None. Its own node, apart
    from the down projection's: the down weight gradients are accumulated before its
    backward allocates the up projection's."""

    @staticmethod
    def forward(ctx, x, w_gate_up, b_gate_up, eti, offsets, tim, args, calls):
        ctx.save_for_backward(x, w_gate_up, eti, offsets, tim)
        ctx.has_bias, ctx.transposed, ctx.calls = b_gate_up is not None, args[1], calls
        h, a = calls.up_with_activation(x, w_gate_up, eti, offsets, tim, b_gate_up, args)
        if a is not None:
            ctx.mark_non_differentiable(a)
        # Else autograd would hand backward a zero-filled [L*K, I] gradient for act(h).
        ctx.set_materialize_grads(False)
        return h, a

    @staticmethod
    def backward(ctx, grad_h, grad_a):
        if grad_h is None:  # nothing reached h (gradients are not materialized)
            return None, None, None, None, None, None, None, None
        x, w_gate_up, eti, offsets, tim = ctx.saved_tensors
        need = ctx.needs_input_grad  # x, w_gate_up, b_gate_up, ...
        grads = _up_backward(_backward_calls(ctx), grad_h, x, w_gate_up, eti, offsets, tim, ctx.has_bias,
                             ctx.transposed, need[0], need[1], need[2])
        return (*grads, None, None, None, None, None)


class _DownNode(torch.autograd.Function):
    """``expert_down`` in eager autograd, through ``calls``, on ``a`` = act(h) where the
    up projection made it (``expert_down_activated``: no activation pass). Given ``up`` (the up
    projection's x, w_gate_up and b_gate_up: ``overwrite_h``), its backward writes dH over
    the h it kept, which is the layer's own: the gradient for h is h itself, afterwards.

    A second backward through the same graph (``retain_graph=True``) finds h overwritten
    and recomputes it from ``up`` (which the up projection's node keeps anyway): one more
    GEMM for the rare second pass, nothing more kept for the first.
    """

    @staticmethod
    def forward(ctx, h, w_down, b_down, tw, eti, offsets, tim, args, calls, up, a):
        ctx.save_for_backward(h, w_down, b_down, tw, eti, offsets, tim)
        ctx.args, ctx.calls, ctx.up, ctx.overwritten = args, calls, up, False
        if a is not None:
            return calls.down_activated(a, w_down, eti, offsets, tim, tw, b_down, args[1])
        return calls.down(h, w_down, eti, offsets, tim, tw, b_down, args)

    @staticmethod
    def backward(ctx, grad_out):
        h, w_down, b_down, tw, eti, offsets, tim = ctx.saved_tensors
        calls = _backward_calls(ctx)
        if ctx.overwritten:  # a second backward: the saved h holds the first one's dH
            x, w_gate_up, b_gate_up = ctx.up
            with torch.no_grad():
                h = calls.up(x, w_gate_up, eti, offsets, tim, b_gate_up, ctx.args[1])
        need = ctx.needs_input_grad  # h, w_down, b_down, tw, ...
        has_b = b_down is not None
        need_w = need[1] or (has_b and need[2])
        if ctx.up is None or torch.is_grad_enabled():
            grad_h, grad_w, grad_b, grad_tw = calls.down_backward(grad_out, h, w_down, eti, offsets, tim, tw, b_down,
                                                                  ctx.args, need_w, False)
        else:
            # The write over h is deliberate and tracked (``overwritten``), so h keeps its
            # version: a second backward may unpack it, and then recomputes it.
            with torch.autograd._unsafe_preserve_version_counter(h):
                grad_h, grad_w, grad_b, grad_tw = calls.down_backward(grad_out, h, w_down, eti, offsets, tim, tw,
                                                                      b_down, ctx.args, need_w, True)
            ctx.overwritten = True
        return (grad_h if need[0] else None, grad_w if need[1] else None, grad_b if has_b and need[2] else None,
                grad_tw if need[3] else None, None, None, None, None, None, None, None)


class _RecomputedLayer(torch.autograd.Function):
    """expert_up + expert_down whose backward recomputes h instead of keeping it, and
    writes dH over the recomputed h (every route, traced too). Its forward needs no h
    either: for a gated activation it runs as ``expert_layer`` (the up GEMM writes act(h)
    alone, where ``settings.up_epilogue_activation`` is on)."""

    @staticmethod
    def forward(x, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim, args, calls):
        if is_gated(args[0]):
            return calls.layer(x, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, args)
        h = calls.up(x, w_gate_up, eti, offsets, tim, b_gate_up, args[1])
        return calls.down(h, w_down, eti, offsets, tim, tw, b_down, args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim, args, calls = inputs
        ctx.save_for_backward(x, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim)
        ctx.args, ctx.calls = args, calls

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim = ctx.saved_tensors
        grads = recomputed_backward(_backward_calls(ctx), grad_out, x, w_gate_up, w_down, b_gate_up, b_down, tw, eti,
                                    offsets, tim, ctx.args, ctx.needs_input_grad[:6])
        return (*grads, None, None, None, None, None)


def recomputed_backward(calls, grad_out, x, w_gate_up, w_down, b_gate_up, b_down, tw, eti, offsets, tim, args, need):
    """The backward of a layer that kept no h (``_RecomputedLayer``, and the op
    ``expert_layer``'s autograd formula): h recomputed and dH written over it, then the
    up projection's gradients, through ``calls``. Returns ``(grad_x, grad_w_gate_up,
    grad_w_down, grad_b_gate_up, grad_b_down, grad_topk_weights)``, None where ``need``
    (flags in the same order) says not needed."""
    need_x, need_wgu, need_wd, need_bgu, need_bd, need_tw = need
    has_bgu, has_bd = b_gate_up is not None, b_down is not None
    grad_h, grad_wd, grad_bd, grad_tw = calls.down_backward_recompute(
        grad_out, x, w_gate_up, w_down, eti, offsets, tim, tw, b_gate_up, b_down, args, need_wd or (has_bd and need_bd))
    grad_x, grad_wgu, grad_bgu = _up_backward(calls, grad_h, x, w_gate_up, eti, offsets, tim, has_bgu, args[1],
                                              need_x, need_wgu, need_bgu)
    return (grad_x, grad_wgu, grad_wd if need_wd else None, grad_bgu, grad_bd if has_bd and need_bd else None,
            grad_tw if need_tw else None)
