"""The expert ops: gathered up projection, activation + down projection + combine, both
in one op that never makes h, and the backward ops; their kernels and fake functions.

What backward keeps: the layer input x, ``h``, the three index arrays and
``topk_weights`` (plus the weights and biases, which are parameters). Neither the
gathered [L*K, d] input, nor the activated [L*K, I] rows, nor the [L*K, d] expert outputs
are saved: backward recomputes the activation from ``h``.

The three index arrays every op takes must be a ``dispatch`` result for the routing at
hand. Every op checks its arguments' shapes, dtypes and devices, and the forward ops the
index arrays' values (offsets from 0, non-decreasing, within the rows; token ids below L;
``token_index_map`` within the rows): on the host for CPU tensors, raising
``ValueError``; for CUDA tensors with one device-side assert (no host sync) that fails
the next synchronizing call (the Triton backward ops trust the arrays a checked forward
saved). ``validate=False`` skips every check, for callers whose arguments are known
valid: ``moe_experts`` (it checked them, and its own ``dispatch`` made the index arrays),
the autograd formulas (a checked forward's saved tensors) and the graphs
``torch.compile`` makes of them (the fake functions, which always check, checked the
shapes when the graph was traced). Small layers pay each check's host time on every step.

Two ops are internal (underscored): ``_expert_up_beside`` (h and act(h) from one up
GEMM, its epilogue writing both on Hopper) and ``_expert_down_activated`` (the down
projection of act(h)), the pair a training layer runs where
``kernels.config.activation_beside_h`` says act(h) beside h pays (eager ``moe_experts``,
and the lowerings of ``expert_up`` + ``expert_down`` in compiled graphs). Their index
arrays always come from a ``dispatch`` in the same call: they check none.
"""

from __future__ import annotations

import torch

from ..activations import is_gated
from ..checks import check_expert_down, check_expert_up, check_fp8_weights, check_grad
from ..kernels import backward_backend, forward_backend
from ..layouts import linear_dims
from . import define

_INDICES = "Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map"
#: The activation's arguments, with their defaults (GPT-OSS's alpha and limit:
#: ``activations.clamped_swiglu_defaults``).
_ACTIVATION = ('str activation="swiglu", bool transposed=False, bool interleaved=False, float alpha=1.702, '
               'float limit=7.0')
_ACTIVATION_REQUIRED = "str activation, bool transposed, bool interleaved, float alpha, float limit"


# --------------------------------------------------------------------------- forward


def _expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up=None,
               transposed=False, validate=True):
    backend = forward_backend(x)
    if validate:
        check_expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed)
        backend.check_index_values("expert_up", expert_token_indices, expert_offsets, token_index_map, x.shape[0])
    return backend.expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up,
                             transposed)


def expert_up_like(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up=None,
                   transposed=False, validate=True):
    _, N, _ = check_expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up,
                              transposed)
    return x.new_empty(expert_token_indices.shape[0], N)


expert_up = define(
    f"expert_up(Tensor x, Tensor w_gate_up, {_INDICES}, Tensor? b_gate_up=None, bool transposed=False, "
    "bool validate=True) -> Tensor", _expert_up, expert_up_like,
    """Up projection of every routed row, in expert order: ``h[L*K, N]``.

    Row r of expert e is ``x[expert_token_indices[r]] @ W_e^T (+ b_gate_up[e])``; the
    token rows are gathered on the fly. ``w_gate_up`` is ``[E, N, d]``, or ``[E, d, N]``
    when ``transposed``; N is 2I for gated activations (in the weight's own column order,
    which ``expert_down`` is told with ``interleaved``) and I otherwise. Sentinel rows
    (past ``expert_offsets[E]``) are zero. ``token_index_map`` is not read here: backward
    needs it to sum each token's K input-gradient rows. ``validate=False`` skips every
    check: only for arguments known valid (see the module's doc).""")


def _expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down=None,
                 activation="swiglu", transposed=False, interleaved=False, alpha=1.702, limit=7.0,
                 validate=True):
    backend = forward_backend(h)
    if validate:
        check_expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
                          activation, transposed)
        backend.check_index_values("expert_down", expert_token_indices, expert_offsets, token_index_map,
                                   topk_weights.shape[0])
    return backend.expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                               b_down, activation, transposed, interleaved, alpha, limit)


def expert_down_like(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down=None,
                     activation="swiglu", transposed=False, interleaved=False, alpha=1.702, limit=7.0,
                     validate=True):
    _, d, _ = check_expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                                b_down, activation, transposed)
    return h.new_empty(topk_weights.shape[0], d)


expert_down = define(
    f"expert_down(Tensor h, Tensor w_down, {_INDICES}, Tensor topk_weights, Tensor? b_down=None, {_ACTIVATION}, "
    "bool validate=True) -> Tensor", _expert_down, expert_down_like,
    """Activation, down projection and weighted combine: ``out[L, d]`` in h's dtype.

    ``a = activation(h)`` (never kept), ``y_r = a_r @ W_e^T (+ b_down[e])`` with
    ``w_down`` ``[E, d, I]`` (``[E, I, d]`` when ``transposed``), and
    ``out[i] = sum_k topk_weights[i, k] * y[token_index_map[i*K+k]]`` in the order
    k = 0..K-1 with float32 accumulation (deterministic). Sentinel rows add nothing.
    ``interleaved`` says h's gate and up columns alternate (GPT-OSS) instead of being two
    halves; ``alpha`` and ``limit`` are read by ``clamped_swiglu`` only.
    ``expert_token_indices`` is not read here: backward gathers grad_out rows with it.
    ``validate=False`` skips every check: only for arguments known valid (see the
    module's doc).""")


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


def _check_layer(x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down, activation, transposed,
                 w_gate_up_scale, w_down_scale):
    """``expert_layer``'s checks (``_check_up_then_down``), and with FP8 weights (scales
    given) theirs (``checks.check_fp8_weights``), the rest checked as if the weights had
    x's dtype. Returns ``(L, N, d)``."""
    if w_gate_up_scale is not None or w_down_scale is not None:
        check_fp8_weights("expert_layer", x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, transposed)
        # Stand-ins of the weights' shapes in x's dtype and device, without memory.
        w_gate_up, w_down = (x.new_empty(1).expand(w.shape) for w in (w_gate_up, w_down))
    return _check_up_then_down("expert_layer", x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up,
                               b_down, activation, transposed)


def _expert_layer(x, w_gate_up, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                  b_gate_up=None, b_down=None, activation="swiglu", transposed=False, interleaved=False, alpha=1.702,
                  limit=7.0, validate=True, w_gate_up_scale=None, w_down_scale=None):
    backend = forward_backend(x)
    if validate:
        _check_layer(x, w_gate_up, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                     b_gate_up, b_down, activation, transposed, w_gate_up_scale, w_down_scale)
        backend.check_index_values("expert_layer", expert_token_indices, expert_offsets, token_index_map, x.shape[0])
    if w_gate_up_scale is not None:
        return backend.expert_layer_fp8(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, expert_token_indices,
                                        expert_offsets, token_index_map, topk_weights, b_gate_up, b_down, activation,
                                        transposed, interleaved, alpha, limit)
    a = backend.expert_up_activated(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up,
                                    transposed, activation, interleaved, alpha, limit)
    return backend.expert_down_activated(a, w_down, expert_token_indices, expert_offsets, token_index_map,
                                         topk_weights, b_down, transposed, gated=is_gated(activation),
                                         backward_follows=False)


def expert_layer_like(x, w_gate_up, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                      b_gate_up=None, b_down=None, activation="swiglu", transposed=False, interleaved=False,
                      alpha=1.702, limit=7.0, validate=True, w_gate_up_scale=None, w_down_scale=None):
    L, _, d = _check_layer(x, w_gate_up, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                           b_gate_up, b_down, activation, transposed, w_gate_up_scale, w_down_scale)
    return x.new_empty(L, d)


expert_layer = define(
    f"expert_layer(Tensor x, Tensor w_gate_up, Tensor w_down, {_INDICES}, Tensor topk_weights, "
    f"Tensor? b_gate_up=None, Tensor? b_down=None, {_ACTIVATION}, bool validate=True, "
    "Tensor? w_gate_up_scale=None, Tensor? w_down_scale=None) -> Tensor",
    _expert_layer, expert_layer_like,
    """``expert_down(expert_up(x, ...), ...)`` in one op that never makes h: the up
    projection writes ``a = activation(h)`` ([L*K, I]) straight from its GEMM's epilogue
    (on Hopper, where the Gluon kernel applies; elsewhere the GEMM then one activation
    pass), and the down projection and combine read it. Arguments as the two ops'.

    FP8 weights: with ``w_gate_up_scale`` and ``w_down_scale`` both weights
    are e4m3 (``torch.float8_e4m3fn``) in 128 x 128 blocks and these are their float32
    scales, in the weight's layout (``moeblaze_ops.fp8.quantize_blocks``; a fine-grained FP8
    checkpoint's ``weight_scale_inv``), and the layer runs the FP8 recipe: x's rows and
    act(h)'s quantized in 1 x 128 tiles, every GEMM on e4m3 operands with both scales
    applied per 128-wide block of its reduction, fp32 accumulation, h and the output in
    x's dtype. No gradients through it yet: its backward raises.

    ``moe_experts`` runs it where nothing is differentiated and for ``recompute=True``.
    Its autograd formula recomputes h (``expert_down_backward_recompute``, then
    ``expert_up_backward``): backward keeps x, the index arrays and ``topk_weights``.""")


def _expert_up_beside(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed,
                      activation, interleaved, alpha, limit):
    return forward_backend(x).expert_up_with_activation(x, w_gate_up, expert_token_indices, expert_offsets,
                                                        token_index_map, b_gate_up, transposed, activation,
                                                        interleaved, alpha, limit)


def _expert_up_beside_like(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up,
                           transposed, activation, interleaved, alpha, limit):
    h = expert_up_like(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed)
    return h, h.new_empty(h.shape[0], h.shape[1] // 2 if is_gated(activation) else h.shape[1])


_expert_up_beside_op = define(
    f"_expert_up_beside(Tensor x, Tensor w_gate_up, {_INDICES}, Tensor? b_gate_up, bool transposed, "
    "str activation, bool interleaved, float alpha, float limit) -> (Tensor, Tensor)",
    _expert_up_beside, _expert_up_beside_like,
    """Internal: ``(h, act(h))`` from one up projection (on Hopper one Gluon GEMM whose
    epilogue writes both), for ``_expert_down_activated``. Index arrays from a
    ``dispatch`` in the same call; unchecked.""")


def _expert_down_activated(a, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
                           transposed, gated):
    return forward_backend(a).expert_down_activated(a, w_down, expert_token_indices, expert_offsets,
                                                    token_index_map, topk_weights, b_down, transposed, gated=gated)


def _expert_down_activated_like(a, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                                b_down, transposed, gated):
    _, d, I = linear_dims(w_down, transposed)
    if a.dim() != 2 or a.shape[1] != I:
        raise ValueError(f"moeblaze._expert_down_activated: argument 'a' must be [L*K, {I}], got {tuple(a.shape)}")
    return a.new_empty(topk_weights.shape[0], d)


_expert_down_activated_op = define(
    f"_expert_down_activated(Tensor a, Tensor w_down, {_INDICES}, Tensor topk_weights, Tensor? b_down, "
    "bool transposed, bool gated) -> Tensor", _expert_down_activated, _expert_down_activated_like,
    """Internal: ``expert_down`` of rows activated already (``a`` = act(h), of a gated
    activation where ``gated``): the down GEMM and the combine, no activation pass. Index
    arrays from a ``dispatch`` in the same call; unchecked.""")


# --------------------------------------------------------------------------- backward


def _check_up_backward(grad_h, x, w_gate_up, eti, offsets, tim, transposed):
    E, N, _ = check_expert_up(x, w_gate_up, eti, offsets, tim, None, transposed, op="expert_up_backward")
    check_grad("expert_up_backward", "grad_h", grad_h, (eti.shape[0], N), x.device)
    return E, N


def _expert_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, has_bias,
                        transposed, need_input_grad=True, need_weight_grad=True, validate=True):
    backend = backward_backend(x)
    if validate:
        _check_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, transposed)
        backend.check_backward_index_values("expert_up_backward", expert_token_indices, expert_offsets,
                                            token_index_map, x.shape[0])
    return backend.expert_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                                      has_bias, transposed, need_input_grad, need_weight_grad)


def _expert_up_backward_like(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, has_bias,
                             transposed, need_input_grad=True, need_weight_grad=True, validate=True):
    E, N = _check_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                              transposed)
    return (torch.empty_like(x) if need_input_grad else x.new_empty(0),
            torch.empty_like(w_gate_up) if need_weight_grad else x.new_empty(0),
            x.new_empty((E, N) if has_bias and need_weight_grad else (0,)))


expert_up_backward = define(
    f"expert_up_backward(Tensor grad_h, Tensor x, Tensor w_gate_up, {_INDICES}, bool has_bias, bool transposed, "
    "bool need_input_grad=True, bool need_weight_grad=True, bool validate=True) -> (Tensor, Tensor, Tensor)",
    _expert_up_backward, _expert_up_backward_like,
    """Gradients of ``expert_up``: ``(grad_x, grad_w_gate_up, grad_b_gate_up)``.

    ``grad_x[i]`` sums token i's K rows of ``grad_h @ W`` in the order k = 0..K-1
    (deterministic). ``grad_b_gate_up`` is ``[E, N]`` when ``has_bias``, else empty.
    Without ``need_input_grad`` (``need_weight_grad``) grad_x (the weight and bias
    gradients) come back empty and are not computed: frozen experts skip their GEMMs.
    ``validate=False`` skips every check (the formulas pass it).""")


def _check_down_backward(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed,
                         op="expert_down_backward"):
    E, d, I = check_expert_down(h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed, op=op)
    check_grad(op, "grad_out", grad_out, (topk_weights.shape[0], d), h.device)
    return E, d


def _down_grads_like(h, w_down, b_down, topk_weights, need_weight_grad):
    """Empty tensors shaped as expert_down_backward's outputs (the fake functions)."""
    grad_b = torch.empty_like(b_down) if b_down is not None and need_weight_grad else h.new_empty(0)
    grad_w = torch.empty_like(w_down) if need_weight_grad else w_down.new_empty(0)
    return torch.empty_like(h), grad_w, grad_b, torch.empty_like(topk_weights)


def _down_backward_kernels(op, grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed,
                           interleaved, alpha, limit, need_weight_grad, in_place, validate):
    backend = backward_backend(h)
    if validate:
        backend.check_backward_index_values(op, eti, offsets, tim, topk_weights.shape[0])
    return backend.expert_down_backward(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, activation,
                                        transposed, interleaved, alpha, limit, in_place=in_place,
                                        need_weight_grad=need_weight_grad)


def _expert_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                          b_down, activation, transposed, interleaved, alpha, limit, need_weight_grad=True,
                          validate=True):
    if validate:
        _check_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                             topk_weights, b_down, activation, transposed)
    return _down_backward_kernels("expert_down_backward", grad_out, h, w_down, expert_token_indices, expert_offsets,
                                  token_index_map, topk_weights, b_down, activation, transposed, interleaved, alpha,
                                  limit, need_weight_grad, False, validate)


def _expert_down_backward_like(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                               topk_weights, b_down, activation, transposed, interleaved, alpha, limit,
                               need_weight_grad=True, validate=True):
    _check_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                         b_down, activation, transposed)
    return _down_grads_like(h, w_down, b_down, topk_weights, need_weight_grad)


_DOWN_BACKWARD_ARGS = (f"Tensor grad_out, Tensor{{mutated}} h, Tensor w_down, {_INDICES}, Tensor topk_weights, "
                       f"Tensor? b_down, {_ACTIVATION_REQUIRED}, bool need_weight_grad=True, bool validate=True")

expert_down_backward = define(
    f"expert_down_backward({_DOWN_BACKWARD_ARGS.format(mutated='')}) -> (Tensor, Tensor, Tensor, Tensor)",
    _expert_down_backward, _expert_down_backward_like,
    """Gradients of ``expert_down``: ``(grad_h, grad_w_down, grad_b_down, grad_topk_weights)``.

    Recomputes the activation from ``h``. ``grad_topk_weights[i, k]`` is
    ``<grad_out[i], y[token_index_map[i*K+k]]>`` (zero for sentinels): the router's
    gradient. ``grad_b_down`` is ``[E, d]`` when ``b_down`` is given, else empty.
    Without ``need_weight_grad`` the weight and bias gradients come back empty and are
    not computed (frozen experts). ``validate=False`` skips every check (the formulas
    pass it).""")


def _expert_down_backward_(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                           b_down, activation, transposed, interleaved, alpha, limit, need_weight_grad=True,
                           validate=True):
    if validate:
        _check_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                             topk_weights, b_down, activation, transposed, op="expert_down_backward_")
        if not h.is_contiguous():
            raise ValueError("moeblaze.expert_down_backward_: argument 'h' must be contiguous (it is overwritten "
                             "with its gradient)")
    return _down_backward_kernels("expert_down_backward_", grad_out, h, w_down, expert_token_indices,
                                  expert_offsets, token_index_map, topk_weights, b_down, activation, transposed,
                                  interleaved, alpha, limit, need_weight_grad, True, validate)[1:]


def _expert_down_backward_like_(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                                topk_weights, b_down, activation, transposed, interleaved, alpha, limit,
                                need_weight_grad=True, validate=True):
    _check_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                         b_down, activation, transposed, op="expert_down_backward_")
    return _down_grads_like(h, w_down, b_down, topk_weights, need_weight_grad)[1:]


expert_down_backward_ = define(
    f"expert_down_backward_({_DOWN_BACKWARD_ARGS.format(mutated='(a!)')}) -> (Tensor, Tensor, Tensor)",
    _expert_down_backward_, _expert_down_backward_like_,
    """``expert_down_backward`` that writes grad_h over ``h`` (contiguous) instead of into
    a new [L*K, N] tensor: returns ``(grad_w_down, grad_b_down, grad_topk_weights)`` and
    leaves the gradient in ``h``. The weight gradients read h before it is overwritten.
    ``moe_experts``'s eager backward runs it on the h it kept, which is its own.""")


def _check_down_backward_recompute(grad_out, x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up,
                                   b_down, activation, transposed):
    """Returns N, the width of the h the op recomputes."""
    op = "expert_down_backward_recompute"
    L, N, d = _check_up_then_down(op, x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up, b_down,
                                  activation, transposed)
    check_grad(op, "grad_out", grad_out, (L, d), x.device)
    return N


def _expert_down_backward_recompute(grad_out, x, w_gate_up, w_down, expert_token_indices, expert_offsets,
                                    token_index_map, topk_weights, b_gate_up, b_down, activation, transposed,
                                    interleaved, alpha, limit, need_weight_grad=True, validate=True):
    if validate:
        _check_down_backward_recompute(grad_out, x, w_gate_up, w_down, expert_token_indices, expert_offsets,
                                       token_index_map, topk_weights, b_gate_up, b_down, activation, transposed)
    h = forward_backend(x).expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                                     b_gate_up, transposed)
    return _down_backward_kernels("expert_down_backward_recompute", grad_out, h, w_down, expert_token_indices,
                                  expert_offsets, token_index_map, topk_weights, b_down, activation, transposed,
                                  interleaved, alpha, limit, need_weight_grad, True, validate)


def _expert_down_backward_recompute_like(grad_out, x, w_gate_up, w_down, expert_token_indices, expert_offsets,
                                         token_index_map, topk_weights, b_gate_up, b_down, activation, transposed,
                                         interleaved, alpha, limit, need_weight_grad=True, validate=True):
    N = _check_down_backward_recompute(grad_out, x, w_gate_up, w_down, expert_token_indices, expert_offsets,
                                       token_index_map, topk_weights, b_gate_up, b_down, activation, transposed)
    h = x.new_empty(expert_token_indices.shape[0], N)
    return _down_grads_like(h, w_down, b_down, topk_weights, need_weight_grad)


expert_down_backward_recompute = define(
    f"expert_down_backward_recompute(Tensor grad_out, Tensor x, Tensor w_gate_up, Tensor w_down, {_INDICES}, "
    f"Tensor topk_weights, Tensor? b_gate_up, Tensor? b_down, {_ACTIVATION_REQUIRED}, "
    "bool need_weight_grad=True, bool validate=True) -> (Tensor, Tensor, Tensor, Tensor)",
    _expert_down_backward_recompute, _expert_down_backward_recompute_like,
    """``expert_down_backward`` that recomputes ``h`` (``expert_up``) itself and writes dH
    over it: the backward of ``expert_layer`` and of ``moe_experts(..., recompute=True)``.

    Returns ``(grad_h, grad_w_down, grad_b_down, grad_topk_weights)`` like
    ``expert_down_backward``. h and dH never exist at once. Being one op, the recompute
    cannot be merged by torch.compile with the forward's up projection (which would make
    the compiled forward save h after all).""")
