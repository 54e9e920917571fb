"""The expert ops: gathered up projection, activation + down projection + combine, and
their backward ops, with fake functions and autograd formulas.

What backward keeps: the layer input x, ``h``, the three index arrays and
``topk_weights`` (plus the weights and biases, which are parameters). Neither the
gathered [L*K, d] input, nor the activated [L*K, I] rows, nor the [L*K, d] expert outputs
are saved: backward recomputes the activation from ``h``.

The three index arrays every op takes must be a ``dispatch`` result for the routing at
hand. The ops check their values (offsets from 0, non-decreasing, within the rows; token
ids below L; ``token_index_map`` within the rows): on the host for CPU tensors, raising
``ValueError``, in every op; for CUDA tensors with one device-side assert (no host sync)
that fails the next synchronizing call, in the forward ops (the backward ops get what
autograd saved from a checked forward).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from .. import settings
from ..activations import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT, is_gated
from ..checks import check_expert_down, check_expert_up, check_grad
from . import document
from ..kernels import backward_backend, forward_backend

# --------------------------------------------------------------------------- expert_up


@document
@torch.library.custom_op("moeblaze::expert_up", mutates_args=())
def expert_up(
    x: Tensor,
    w_gate_up: Tensor,
    expert_token_indices: Tensor,
    expert_offsets: Tensor,
    token_index_map: Tensor,
    b_gate_up: Optional[Tensor] = None,
    transposed: bool = False,
) -> Tensor:
    """Up projection of every routed row, in expert order: ``h[L*K, N]``.

    Row r of expert e is ``x[expert_token_indices[r]] @ W_e^T (+ b_gate_up[e])``; the
    token rows are gathered on the fly. ``w_gate_up`` is ``[E, N, d]``, or ``[E, d, N]``
    when ``transposed``; N is 2I for gated activations (in the weight's own column order,
    which ``expert_down`` is told with ``interleaved``) and I otherwise. Sentinel rows
    (past ``expert_offsets[E]``) are zero. ``token_index_map`` is not read here: backward
    needs it to sum each token's K input-gradient rows.
    """
    check_expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed)
    backend = forward_backend(x)
    backend.check_index_values("expert_up", expert_token_indices, expert_offsets, token_index_map, x.shape[0])
    return backend.expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                                   b_gate_up, transposed)


@expert_up.register_fake
def expert_up_like(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up=None,
                   transposed=False):
    _, N, _ = check_expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                              b_gate_up, transposed)
    return x.new_empty(expert_token_indices.shape[0], N)


@document
@torch.library.custom_op("moeblaze::expert_up_backward", mutates_args=())
def expert_up_backward(
    grad_h: Tensor,
    x: Tensor,
    w_gate_up: Tensor,
    expert_token_indices: Tensor,
    expert_offsets: Tensor,
    token_index_map: Tensor,
    has_bias: bool,
    transposed: bool,
    need_input_grad: bool = True,
    need_weight_grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``expert_up``: ``(grad_x, grad_w_gate_up, grad_b_gate_up)``.

    ``grad_x[i]`` sums token i's K rows of ``grad_h @ W`` in the order k = 0..K-1
    (deterministic). ``grad_b_gate_up`` is ``[E, N]`` when ``has_bias``, else empty.
    Without ``need_input_grad`` (``need_weight_grad``) grad_x (the weight and bias
    gradients) come back empty and are not computed: frozen experts skip their GEMMs.
    """
    _check_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, transposed)
    backend = backward_backend(x)
    backend.check_backward_index_values("expert_up_backward", expert_token_indices, expert_offsets,
                                        token_index_map, x.shape[0])
    return backend.expert_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets,
                                                  token_index_map, has_bias, transposed, need_input_grad,
                                                  need_weight_grad)


def _check_up_backward(grad_h, x, w_gate_up, eti, offsets, tim, transposed):
    E, N, _ = check_expert_up(x, w_gate_up, eti, offsets, tim, None, transposed, op="expert_up_backward")
    check_grad("expert_up_backward", "grad_h", grad_h, (eti.shape[0], N), x.device)
    return E, N


@expert_up_backward.register_fake
def _(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, has_bias, transposed,
      need_input_grad=True, need_weight_grad=True):
    E, N = _check_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                              transposed)
    return _up_grads_like(x, w_gate_up, E, N, has_bias, need_input_grad, need_weight_grad)


def _up_grads_like(x, w_gate_up, E, N, has_bias, need_input_grad, need_weight_grad):
    """Empty tensors shaped as expert_up_backward's outputs (the fake functions)."""
    return (torch.empty_like(x) if need_input_grad else x.new_empty(0),
            torch.empty_like(w_gate_up) if need_weight_grad else x.new_empty(0),
            x.new_empty((E, N) if has_bias and need_weight_grad else (0,)))


def _expert_up_setup_context(ctx, inputs, output):
    x, w_gate_up, eti, offsets, tim, b_gate_up, transposed = inputs
    ctx.save_for_backward(x, w_gate_up, eti, offsets, tim)
    ctx.has_bias = b_gate_up is not None
    ctx.transposed = transposed


def _expert_up_backward(ctx, grad_h):
    x, w_gate_up, eti, offsets, tim = ctx.saved_tensors
    need = ctx.needs_input_grad  # x, w_gate_up, eti, offsets, tim, b_gate_up, transposed
    need_x, need_w = need[0], need[1] or (ctx.has_bias and need[5])
    grad_x, grad_w, grad_b = torch.ops.moeblaze.expert_up_backward(
        grad_h, x, w_gate_up, eti, offsets, tim, ctx.has_bias, ctx.transposed, need_x, need_w)
    return (grad_x if need_x else None, grad_w if need[1] else None, None, None, None,
            grad_b if ctx.has_bias and need[5] else None, None)


torch.library.register_autograd("moeblaze::expert_up", _expert_up_backward, setup_context=_expert_up_setup_context)

# --------------------------------------------------------------------------- expert_down


@document
@torch.library.custom_op("moeblaze::expert_down", mutates_args=())
def expert_down(
    h: Tensor,
    w_down: Tensor,
    expert_token_indices: Tensor,
    expert_offsets: Tensor,
    token_index_map: Tensor,
    topk_weights: Tensor,
    b_down: Optional[Tensor] = None,
    activation: str = "swiglu",
    transposed: bool = False,
    interleaved: bool = False,
    alpha: float = CLAMPED_SWIGLU_ALPHA,
    limit: float = CLAMPED_SWIGLU_LIMIT,
) -> Tensor:
    """Activation, down projection and weighted combine: ``out[L, d]`` in h's dtype.

    ``a = activation(h)`` (never stored), ``y_r = a_r @ W_e^T (+ b_down[e])`` with
    ``w_down`` ``[E, d, I]`` (``[E, I, d]`` when ``transposed``), and
    ``out[i] = sum_k topk_weights[i, k] * y[token_index_map[i*K+k]]`` in the order
    k = 0..K-1 with float32 accumulation (deterministic). Sentinel rows add nothing.
    ``interleaved`` says h's gate and up columns alternate (GPT-OSS) instead of being two
    halves; ``alpha`` and ``limit`` are read by ``clamped_swiglu`` only.
    ``expert_token_indices`` is not read here: backward gathers grad_out rows with it.
    """
    check_expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                      b_down, activation, transposed)
    backend = forward_backend(h)
    backend.check_index_values("expert_down", expert_token_indices, expert_offsets, token_index_map,
                               topk_weights.shape[0])
    return backend.expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map,
                                     topk_weights, b_down, activation, transposed, interleaved, alpha, limit)


@expert_down.register_fake
def expert_down_like(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down=None,
                     activation="swiglu", transposed=False, interleaved=False, alpha=CLAMPED_SWIGLU_ALPHA,
                     limit=CLAMPED_SWIGLU_LIMIT):
    _, d, _ = check_expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map,
                                topk_weights, b_down, activation, transposed)
    return h.new_empty(topk_weights.shape[0], d)


@document
@torch.library.custom_op("moeblaze::expert_down_backward", mutates_args=())
def expert_down_backward(
    grad_out: Tensor,
    h: Tensor,
    w_down: Tensor,
    expert_token_indices: Tensor,
    expert_offsets: Tensor,
    token_index_map: Tensor,
    topk_weights: Tensor,
    b_down: Optional[Tensor],
    activation: str,
    transposed: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    need_weight_grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``expert_down``: ``(grad_h, grad_w_down, grad_b_down, grad_topk_weights)``.

    Recomputes the activation from ``h``. ``grad_topk_weights[i, k]`` is
    ``<grad_out[i], y[token_index_map[i*K+k]]>`` (zero for sentinels): the router's
    gradient. ``grad_b_down`` is ``[E, d]`` when ``b_down`` is given, else empty.
    Without ``need_weight_grad`` the weight and bias gradients come back empty and are
    not computed (frozen experts).
    """
    _check_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                         topk_weights, b_down, activation, transposed)
    backend = backward_backend(h)
    backend.check_backward_index_values("expert_down_backward", expert_token_indices, expert_offsets,
                                        token_index_map, topk_weights.shape[0])
    return backend.expert_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets,
                                                    token_index_map, topk_weights, b_down, activation, transposed,
                                                    interleaved, alpha, limit, need_weight_grad=need_weight_grad)


def _check_down_backward(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed):
    E, d, I = check_expert_down(h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed,
                                op="expert_down_backward")
    check_grad("expert_down_backward", "grad_out", grad_out, (topk_weights.shape[0], d), h.device)
    return E, d


def _check_up_then_down(op, x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down, activation,
                        transposed):
    """The checks of an op that runs the up projection and then the down projection (or
    its backward) on the h it makes: ``expert_up``'s, x and ``topk_weights`` of one token
    count, then ``expert_down``'s on an h of the up projection's shape. Returns
    ``(L, N, d)``."""
    _, N, d = check_expert_up(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed, op=op)
    if topk_weights.dim() == 2 and topk_weights.shape[0] != x.shape[0]:
        raise ValueError(f"moeblaze.{op}: argument 'topk_weights' must be [L, K] with L = {x.shape[0]} "
                         f"(x.shape[0]), got {tuple(topk_weights.shape)}")
    h = x.new_empty(1).expand(eti.shape[0], N)  # h's shape, dtype and device, without its memory
    check_expert_down(h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed, op=op)
    return x.shape[0], N, d


def _down_grads_like(h, w_down, b_down, topk_weights, need_weight_grad):
    """Empty tensors shaped as expert_down_backward's outputs (the fake functions)."""
    grad_b = torch.empty_like(b_down) if b_down is not None and need_weight_grad else h.new_empty(0)
    grad_w = torch.empty_like(w_down) if need_weight_grad else w_down.new_empty(0)
    return torch.empty_like(h), grad_w, grad_b, torch.empty_like(topk_weights)


@expert_down_backward.register_fake
def _(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
      activation, transposed, interleaved, alpha, limit, need_weight_grad=True):
    _check_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                         topk_weights, b_down, activation, transposed)
    return _down_grads_like(h, w_down, b_down, topk_weights, need_weight_grad)


@document
@torch.library.custom_op("moeblaze::expert_down_backward_", mutates_args=("h",))
def expert_down_backward_(
    grad_out: Tensor,
    h: Tensor,
    w_down: Tensor,
    expert_token_indices: Tensor,
    expert_offsets: Tensor,
    token_index_map: Tensor,
    topk_weights: Tensor,
    b_down: Optional[Tensor],
    activation: str,
    transposed: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    need_weight_grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """``expert_down_backward`` that writes grad_h over ``h`` (contiguous) instead of into
    a new [L*K, N] tensor: returns ``(grad_w_down, grad_b_down, grad_topk_weights)`` and
    leaves the gradient in ``h``. The weight gradients read h before it is overwritten.
    ``moe_experts`` uses it in eager backward, where h is its own.
    """
    _check_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                         topk_weights, b_down, activation, transposed)
    if not h.is_contiguous():
        raise ValueError("moeblaze.expert_down_backward_: argument 'h' must be contiguous (it is overwritten "
                         "with its gradient)")
    backend = backward_backend(h)
    backend.check_backward_index_values("expert_down_backward_", expert_token_indices, expert_offsets,
                                        token_index_map, topk_weights.shape[0])
    _, grad_w, grad_b, grad_tw = backend.expert_down_backward(
        grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
        activation, transposed, interleaved, alpha, limit, in_place=True, need_weight_grad=need_weight_grad)
    return grad_w, grad_b, grad_tw


@expert_down_backward_.register_fake
def _(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
      activation, transposed, interleaved, alpha, limit, need_weight_grad=True):
    _check_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                         topk_weights, b_down, activation, transposed)
    return _down_grads_like(h, w_down, b_down, topk_weights, need_weight_grad)[1:]


@document
@torch.library.custom_op("moeblaze::expert_down_backward_recompute", mutates_args=())
def expert_down_backward_recompute(
    grad_out: Tensor,
    x: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    expert_token_indices: Tensor,
    expert_offsets: Tensor,
    token_index_map: Tensor,
    topk_weights: Tensor,
    b_gate_up: Optional[Tensor],
    b_down: Optional[Tensor],
    activation: str,
    transposed: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    need_weight_grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``expert_down_backward`` that recomputes ``h`` (``expert_up``) itself and writes dH
    over it: the backward of ``moe_experts(..., recompute=True)``.

    Returns ``(grad_h, grad_w_down, grad_b_down, grad_topk_weights)`` like
    ``expert_down_backward``. h and dH never exist at once. Being one op, the recompute
    cannot be merged by torch.compile with the forward's ``expert_up`` (which would make
    the compiled forward save h after all).
    """
    _check_down_backward_recompute(grad_out, x, w_gate_up, w_down, expert_token_indices, expert_offsets,
                                   token_index_map, topk_weights, b_gate_up, b_down, activation, transposed)
    backward_backend(x).check_backward_index_values("expert_down_backward_recompute", expert_token_indices,
                                                    expert_offsets, token_index_map, x.shape[0])
    h = forward_backend(x).expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                                     b_gate_up, transposed)
    return backward_backend(h).expert_down_backward(
        grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
        activation, transposed, interleaved, alpha, limit, in_place=True, need_weight_grad=need_weight_grad)


def _check_down_backward_recompute(grad_out, x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up,
                                   b_down, activation, transposed):
    """Returns N, the width of the h the op recomputes."""
    op = "expert_down_backward_recompute"
    L, N, d = _check_up_then_down(op, x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down,
                                  activation, transposed)
    check_grad(op, "grad_out", grad_out, (L, d), x.device)
    return N


@expert_down_backward_recompute.register_fake
def _(grad_out, x, w_gate_up, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
      b_gate_up, b_down, activation, transposed, interleaved, alpha, limit, need_weight_grad=True):
    N = _check_down_backward_recompute(grad_out, x, w_gate_up, w_down, expert_token_indices, expert_offsets,
                                       token_index_map, topk_weights, b_gate_up, b_down, activation, transposed)
    h = x.new_empty(expert_token_indices.shape[0], N)
    return _down_grads_like(h, w_down, b_down, topk_weights, need_weight_grad)


def _expert_down_setup_context(ctx, inputs, output):
    h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed, interleaved, alpha, limit = inputs
    ctx.save_for_backward(h, w_down, eti, offsets, tim, topk_weights, b_down)
    ctx.args = (activation, transposed, interleaved, alpha, limit)


def _expert_down_backward(ctx, grad_out):
    h, w_down, eti, offsets, tim, topk_weights, b_down = ctx.saved_tensors
    need = ctx.needs_input_grad  # h, w_down, eti, offsets, tim, topk_weights, b_down, ...
    need_w = need[1] or (b_down is not None and need[6])
    grad_h, grad_w, grad_b, grad_tw = torch.ops.moeblaze.expert_down_backward(
        grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, *ctx.args, need_w)
    return (grad_h, grad_w if need[1] else None, None, None, None, grad_tw,
            grad_b if b_down is not None and need[6] else None, None, None, None, None, None)


torch.library.register_autograd("moeblaze::expert_down", _expert_down_backward,
                                setup_context=_expert_down_setup_context)


# --------------------------------------------------------------------------- expert_layer


@document
@torch.library.custom_op("moeblaze::expert_layer", mutates_args=())
def expert_layer(
    x: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    expert_token_indices: Tensor,
    expert_offsets: Tensor,
    token_index_map: Tensor,
    topk_weights: Tensor,
    b_gate_up: Optional[Tensor] = None,
    b_down: Optional[Tensor] = None,
    activation: str = "swiglu",
    transposed: bool = False,
    interleaved: bool = False,
    alpha: float = CLAMPED_SWIGLU_ALPHA,
    limit: float = CLAMPED_SWIGLU_LIMIT,
) -> Tensor:
    """``expert_down(expert_up(x, ...), ...)`` in one op that never makes h: the up
    projection writes ``a = activation(h)`` ([L*K, I]) straight from its GEMM's epilogue
    (on Hopper, where the Gluon kernel applies; elsewhere the GEMM then one activation
    pass), and the down projection and combine read it. Arguments as the two ops'.

    ``moe_experts`` calls it for a gated activation where nothing is differentiated, and
    in the forward of ``recompute=True``. With ``settings.up_epilogue_activation`` off it
    makes h after all (the up projection, then ``expert_down``'s activation pass on h).
    Its autograd formula recomputes h, as ``moe_experts(..., recompute=True)`` does:
    ``expert_down_backward_recompute`` then ``expert_up_backward``.
    """
    _check_up_then_down("expert_layer", x, w_gate_up, w_down, expert_token_indices, expert_offsets, token_index_map,
                        topk_weights, b_gate_up, b_down, activation, transposed)
    backend = forward_backend(x)
    backend.check_index_values("expert_layer", expert_token_indices, expert_offsets, token_index_map, x.shape[0])
    return layer_kernels(backend, x, w_gate_up, w_down, expert_token_indices, expert_offsets, token_index_map,
                         topk_weights, b_gate_up, b_down, activation, transposed, interleaved, alpha, limit)


def layer_kernels(backend, x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down, activation,
                  transposed, interleaved, alpha, limit, profiled=contextlib.nullcontext):
    """``expert_layer`` on ``backend``'s kernels, its arguments unchecked: act(h) from the
    up projection where ``settings.up_epilogue_activation`` is on, else h, activated by the
    down projection. ``profiled(name)`` wraps each projection (a profiler range)."""
    if not settings.current().up_epilogue_activation:
        with profiled("moeblaze::expert_up"):
            h = backend.expert_up(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed)
        with profiled("moeblaze::expert_down"):
            return backend.expert_down(h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed,
                                       interleaved, alpha, limit)
    with profiled("moeblaze::expert_up"):
        a = backend.expert_up_activated(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed, activation,
                                        interleaved, alpha, limit)
    with profiled("moeblaze::expert_down"):
        return backend.expert_down_activated(a, w_down, eti, offsets, tim, topk_weights, b_down, transposed,
                                             gated=is_gated(activation))


@expert_layer.register_fake
def expert_layer_like(x, w_gate_up, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                      b_gate_up=None, b_down=None, activation="swiglu", transposed=False, interleaved=False,
                      alpha=CLAMPED_SWIGLU_ALPHA, limit=CLAMPED_SWIGLU_LIMIT):
    L, _, d = _check_up_then_down("expert_layer", x, w_gate_up, w_down, expert_token_indices, expert_offsets,
                                  token_index_map, topk_weights, b_gate_up, b_down, activation, transposed)
    return x.new_empty(L, d)


def _expert_layer_setup_context(ctx, inputs, output):
    x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down, *args = inputs
    ctx.save_for_backward(x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down)
    ctx.args = tuple(args)  # activation, transposed, interleaved, alpha, limit


def _expert_layer_backward(ctx, grad_out):
    # The layer's own recompute backward, through the ops. Imported here: the layer module
    # imports this one.
    from ..functional import _OP_CALLS, recomputed_backward

    x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down = ctx.saved_tensors
    need = ctx.needs_input_grad  # x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down, ...
    grad_x, grad_wgu, grad_wd, grad_bgu, grad_bd, grad_tw = recomputed_backward(
        _OP_CALLS, grad_out, x, w_gate_up, w_down, b_gate_up, b_down, topk_weights, eti, offsets, tim, ctx.args,
        (need[0], need[1], need[2], need[7], need[8], need[6]))
    return (grad_x, grad_wgu, grad_wd, None, None, None, grad_tw, grad_bgu, grad_bd, None, None, None, None, None)


torch.library.register_autograd("moeblaze::expert_layer", _expert_layer_backward,
                                setup_context=_expert_layer_setup_context)


# --------------------------------------------------------------------------- double backward


def _refuse_double_backward(name):
    def backward(ctx, *grads):
        raise NotImplementedError(f"moeblaze.{name}: gradients of gradients (double backward, e.g. gradgradcheck "
                                  "or create_graph=True followed by another backward) are not supported")

    return backward


def _nothing_to_save(ctx, inputs, output):
    pass


# The backward ops are differentiable only in name: a second differentiation says so clearly
# (without a formula torch would blame a missing registration).
for _name in ("expert_up_backward", "expert_down_backward", "expert_down_backward_recompute"):
    torch.library.register_autograd(f"moeblaze::{_name}", _refuse_double_backward(_name),
                                    setup_context=_nothing_to_save)
