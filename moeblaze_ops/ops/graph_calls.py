"""Internal ops through which compiled graphs call the kernels that the lowerings keep as
extern calls (the forward ops where their GEMMs run on Gluon, the backward ops), where
``settings.lean_graph_calls`` asks for them. (``dispatch`` needs none: it is defined
through the low-level API itself, and its argument checks cost a couple of microseconds.)

A call of a ``torch.library.custom_op`` runs Python wrappers around the op's function:
autograd, ``torch._disable_dynamo``, the backend redispatch and, for an op that mutates
an argument, a version bump that rebinds the whole schema. An op defined and implemented
through the low-level ``torch.library.Library`` API costs the dispatcher's call alone
(``scripts/host_overhead.py --op-registration``; docs/perf-notes.md has the numbers). A
compiled layer calls two backward ops a step.

These ops call the backend's kernels without the public ops' argument checks: those ran
on the fake tensors when the graph was traced, and the index arrays are the forward's,
which checked them; the forward ops' twins are called only with index arrays that a
``dispatch`` in the same graph made. The forward twins take their public op's schema. They are not public. They have no autograd (a compiled backward runs
without grad), and the in-place form bumps no version counter (its h is a buffer the
compiled backward owns).

Two have no public op: ``_up_with_activation_kernels`` (h and act(h) from the up
projection) and ``_down_activated_kernels`` (the down projection of act(h)), the pair a
training graph's lowering calls where the up GEMM's epilogue writes act(h) beside h
(``settings.activation_beside_h``; ``lowerings/expert_ops.py``). Their index arrays too
come from a ``dispatch`` in the same graph.
"""

from __future__ import annotations

import torch

from ..activations import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT, is_gated
from ..kernels import backward_backend, forward_backend
from ..layouts import linear_dims
from .experts import (_check_down_backward, _check_up_backward, _down_grads_like, _up_grads_like, expert_down_like,
                      expert_layer_like, expert_up_like, layer_kernels)

_lib = torch.library.Library("moeblaze", "FRAGMENT")

_UP = ("Tensor grad_h, Tensor x, Tensor w_gate_up, Tensor expert_token_indices, Tensor expert_offsets, "
       "Tensor token_index_map, bool has_bias, bool transposed, bool need_input_grad=True, bool need_weight_grad=True")
_DOWN = ("Tensor grad_out, Tensor{mutated} h, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, "
         "Tensor token_index_map, Tensor topk_weights, Tensor? b_down, str activation, bool transposed, "
         "bool interleaved, float alpha, float limit, bool need_weight_grad=True")
#: Each forward twin and its public op.
FORWARD_TWINS = {"_up_kernels": "expert_up", "_down_kernels": "expert_down", "_layer_kernels": "expert_layer"}
for _twin, _public in FORWARD_TWINS.items():
    _schema = str(getattr(torch.ops.moeblaze, _public).default._schema)
    _lib.define(_schema.replace(f"moeblaze::{_public}(", f"{_twin}(", 1))
# act(h) beside h (the lowerings' plan for a training graph, see lowerings/expert_ops.py):
# the up projection's h and act(h) from one op, and the down projection of act(h).
_lib.define("_up_with_activation_kernels(Tensor x, Tensor w_gate_up, Tensor expert_token_indices, "
            "Tensor expert_offsets, Tensor token_index_map, Tensor? b_gate_up, bool transposed, str activation, "
            "bool interleaved, float alpha, float limit) -> (Tensor, Tensor)")
_lib.define("_down_activated_kernels(Tensor a, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, "
            "Tensor token_index_map, Tensor topk_weights, Tensor? b_down, bool transposed) -> Tensor")
_lib.define(f"_up_backward_kernels({_UP}) -> (Tensor, Tensor, Tensor)")
_lib.define(f"_down_backward_kernels({_DOWN.format(mutated='')}) -> (Tensor, Tensor, Tensor, Tensor)")
_lib.define(f"_down_backward_kernels_({_DOWN.format(mutated='(a!)')}) -> (Tensor, Tensor, Tensor)")


def _up_kernels(x, w_gate_up, eti, offsets, tim, b_gate_up=None, transposed=False):
    return forward_backend(x).expert_up(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed)


def _down_kernels(h, w_down, eti, offsets, tim, topk_weights, b_down=None, activation="swiglu", transposed=False,
                  interleaved=False, alpha=CLAMPED_SWIGLU_ALPHA, limit=CLAMPED_SWIGLU_LIMIT):
    return forward_backend(h).expert_down(h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed,
                                          interleaved, alpha, limit)


def _layer_kernels(x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up=None, b_down=None,
                   activation="swiglu", transposed=False, interleaved=False, alpha=CLAMPED_SWIGLU_ALPHA,
                   limit=CLAMPED_SWIGLU_LIMIT):
    return layer_kernels(forward_backend(x), x, w_gate_up, w_down, eti, offsets, tim, topk_weights, b_gate_up,
                         b_down, activation, transposed, interleaved, alpha, limit)


def _up_with_activation_kernels(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed, activation, interleaved,
                                alpha, limit):
    return forward_backend(x).expert_up_with_activation(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed,
                                                        activation, interleaved, alpha, limit, always=True)


def _down_activated_kernels(a, w_down, eti, offsets, tim, topk_weights, b_down, transposed):
    # The lowerings plan act(h) beside h for gated activations only.
    return forward_backend(a).expert_down_activated(a, w_down, eti, offsets, tim, topk_weights, b_down, transposed,
                                                    gated=True)


def _up_backward_kernels(grad_h, x, w_gate_up, eti, offsets, tim, has_bias, transposed, need_input_grad=True,
                         need_weight_grad=True):
    return backward_backend(x).expert_up_backward(grad_h, x, w_gate_up, eti, offsets, tim, has_bias, transposed,
                                                  need_input_grad, need_weight_grad)


def _down_backward_kernels(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed,
                           interleaved, alpha, limit, need_weight_grad=True):
    return backward_backend(h).expert_down_backward(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down,
                                                    activation, transposed, interleaved, alpha, limit,
                                                    need_weight_grad=need_weight_grad)


def _down_backward_kernels_(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed,
                            interleaved, alpha, limit, need_weight_grad=True):
    return backward_backend(h).expert_down_backward(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down,
                                                    activation, transposed, interleaved, alpha, limit, in_place=True,
                                                    need_weight_grad=need_weight_grad)[1:]


for _fn in (_up_kernels, _down_kernels, _layer_kernels, _up_with_activation_kernels, _down_activated_kernels,
            _up_backward_kernels, _down_backward_kernels, _down_backward_kernels_):
    _lib.impl(_fn.__name__, _fn, "CompositeExplicitAutograd")


torch.library.register_fake("moeblaze::_up_kernels", expert_up_like, lib=_lib)
torch.library.register_fake("moeblaze::_down_kernels", expert_down_like, lib=_lib)
torch.library.register_fake("moeblaze::_layer_kernels", expert_layer_like, lib=_lib)


@torch.library.register_fake("moeblaze::_up_with_activation_kernels", lib=_lib)
def _(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed, activation, interleaved, alpha, limit):
    h = expert_up_like(x, w_gate_up, eti, offsets, tim, b_gate_up, transposed)
    return h, h.new_empty(h.shape[0], h.shape[1] // 2 if is_gated(activation) else h.shape[1])


@torch.library.register_fake("moeblaze::_down_activated_kernels", lib=_lib)
def _(a, w_down, eti, offsets, tim, topk_weights, b_down, transposed):
    _, d, I = linear_dims(w_down, transposed)
    if a.dim() != 2 or a.shape[1] != I:
        raise ValueError(f"moeblaze._down_activated_kernels: argument 'a' must be [L*K, {I}], got {tuple(a.shape)}")
    return a.new_empty(topk_weights.shape[0], d)


@torch.library.register_fake("moeblaze::_up_backward_kernels", lib=_lib)
def _(grad_h, x, w_gate_up, eti, offsets, tim, has_bias, transposed, need_input_grad=True, need_weight_grad=True):
    E, N = _check_up_backward(grad_h, x, w_gate_up, eti, offsets, tim, transposed)
    return _up_grads_like(x, w_gate_up, E, N, has_bias, need_input_grad, need_weight_grad)


@torch.library.register_fake("moeblaze::_down_backward_kernels", lib=_lib)
def _(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed, interleaved, alpha,
      limit, need_weight_grad=True):
    _check_down_backward(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed)
    return _down_grads_like(h, w_down, b_down, topk_weights, need_weight_grad)


@torch.library.register_fake("moeblaze::_down_backward_kernels_", lib=_lib)
def _(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed, interleaved, alpha,
      limit, need_weight_grad=True):
    _check_down_backward(grad_out, h, w_down, eti, offsets, tim, topk_weights, b_down, activation, transposed)
    return _down_grads_like(h, w_down, b_down, topk_weights, need_weight_grad)[1:]
