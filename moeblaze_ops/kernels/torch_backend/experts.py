"""Portable PyTorch kernels of the expert ops: the gathered grouped GEMMs and the combine.

Rows are processed expert by expert (a loop over experts, never over tokens): each
expert gathers its token rows through ``expert_token_indices``, so no [L*K, d] copy of
the input is made. Half-precision inputs compute in float32, float64 in float64.

The expert row ranges are read to the host (``expert_offsets.tolist()``): free on CPU,
a device sync on CUDA, where the Triton kernels take over.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import fp8
from ...activations import activation_backward, activation_forward
from ...layouts import expert_matrix, linear_dims


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expert_ranges(expert_offsets: torch.Tensor):
    """(expert, first row, end row) of every expert that owns rows."""
    bounds = expert_offsets.tolist()
    return [(e, s, t) for e, (s, t) in enumerate(zip(bounds[:-1], bounds[1:])) if t > s]


def _matrix(w: torch.Tensor, e: int, transposed: bool, acc: torch.dtype) -> torch.Tensor:
    """Expert e's weight as [in, out] in ``acc``, so that y = x @ W."""
    return expert_matrix(w, e, transposed).to(acc)


def _store_weight_grad(grad_w: torch.Tensor, e: int, grad: torch.Tensor, transposed: bool) -> None:
    """Writes the [in, out] gradient of ``_matrix`` back in the weight's layout."""
    expert_matrix(grad_w, e, transposed).copy_(grad)


def _gather_rows(x: torch.Tensor, expert_token_indices: torch.Tensor, s: int, t: int, acc) -> torch.Tensor:
    return x.index_select(0, expert_token_indices[s:t].long()).to(acc)


def combine(rows: torch.Tensor, token_index_map: torch.Tensor, num_tokens: int,
            topk_weights: Optional[torch.Tensor] = None, num_real_rows: Optional[int] = None) -> torch.Tensor:
    """out[i] = sum over k = 0..K-1, in that order, of w[i, k] * rows[token_index_map[i*K+k]].

    ``rows`` is in expert order; rows at or past ``num_real_rows`` (sentinels) add nothing,
    whatever their weight (an inf or NaN router weight there too). Without
    ``topk_weights`` every weight is 1 (the input-gradient reduction).
    """
    out = rows.new_zeros(num_tokens, rows.shape[1])
    if num_tokens == 0 or token_index_map.numel() == 0:
        return out
    index = token_index_map.view(num_tokens, -1).long()
    for k in range(index.shape[1]):
        picked = rows.index_select(0, index[:, k])
        if topk_weights is not None:
            w = topk_weights[:, k, None].to(rows.dtype)
            if num_real_rows is not None:
                w = torch.where(index[:, k, None] < num_real_rows, w, 0.0)
            picked = picked * w
        out += picked
    return out


def row_weights(token_index_map: torch.Tensor, topk_weights: torch.Tensor, acc) -> torch.Tensor:
    """Each routed row's combine weight, in expert order (a permutation: no collisions)."""
    w = torch.zeros(token_index_map.shape[0], dtype=acc, device=topk_weights.device)
    w[token_index_map.long()] = topk_weights.reshape(-1).to(acc)
    return w


def expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
              b_gate_up, transposed, *, matrix=_matrix, dtype=None):
    """h in ``dtype`` (x's by default); ``matrix(w, e, transposed, acc)`` gives expert e's
    weight as [in, out] (``_fp8_matrix`` for e4m3 weights, with their scales bound)."""
    acc = _acc_dtype(dtype or x.dtype)
    _, N, _ = linear_dims(w_gate_up, transposed)
    h = torch.zeros(expert_token_indices.shape[0], N, dtype=dtype or x.dtype, device=x.device)
    for e, s, t in _expert_ranges(expert_offsets):
        he = _gather_rows(x, expert_token_indices, s, t, acc) @ matrix(w_gate_up, e, transposed, acc)
        if b_gate_up is not None:
            he += b_gate_up[e].to(acc)
        h[s:t] = he
    return h


def expert_up_activated(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed,
                        activation, interleaved, alpha, limit):
    """act(h) of ``expert_up``'s rows, in h's dtype, for ``expert_down_activated``."""
    h = expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed)
    return _activated(h, activation, alpha, limit, interleaved)


def _activated(h, activation, alpha, limit, interleaved):
    """act(h), computed in the accumulation dtype and stored in h's."""
    return activation_forward(h.to(_acc_dtype(h.dtype)), activation, alpha, limit, interleaved).to(h.dtype)


def expert_up_with_activation(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up,
                              transposed, activation, interleaved, alpha, limit):
    """``(h, a)``: ``expert_up``'s h and a = act(h) in h's dtype (as the Triton backend's
    epilogue writes it)."""
    h = expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed)
    return h, _activated(h, activation, alpha, limit, interleaved)


def expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                b_down, activation, transposed, interleaved, alpha, limit):
    a = activation_forward(h.to(_acc_dtype(h.dtype)), activation, alpha, limit, interleaved)
    return _down_projection(a, h.dtype, w_down, expert_offsets, token_index_map, topk_weights, b_down, transposed)


def expert_down_activated(a, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
                          transposed, gated=False, backward_follows=True):
    """``expert_down`` of rows activated already (act(h), from ``expert_up_activated``);
    ``gated`` and ``backward_follows`` (how wide the Triton kernels' column slabs may be)
    change nothing here."""
    return _down_projection(a, a.dtype, w_down, expert_offsets, token_index_map, topk_weights, b_down, transposed)


def _down_projection(a, dtype, w_down, expert_offsets, token_index_map, topk_weights, b_down, transposed,
                     matrix=_matrix):
    """The down GEMM of every expert's activated rows ``a`` and the combine, in the
    accumulation dtype, the result in ``dtype``; sentinel rows stay zero. ``matrix`` as
    ``expert_up``'s."""
    acc = _acc_dtype(dtype)
    _, d, _ = linear_dims(w_down, transposed)
    y = torch.zeros(a.shape[0], d, dtype=acc, device=a.device)
    for e, s, t in _expert_ranges(expert_offsets):
        ye = a[s:t].to(acc) @ matrix(w_down, e, transposed, acc)
        if b_down is not None:
            ye += b_down[e].to(acc)
        y[s:t] = ye
    return combine(y, token_index_map, topk_weights.shape[0], topk_weights,
                   num_real_rows=int(expert_offsets[-1])).to(dtype)


def expert_layer_fp8(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, expert_token_indices, expert_offsets,
                     token_index_map, topk_weights, b_gate_up, b_down, activation, transposed, interleaved, alpha,
                     limit):
    """``expert_layer`` on FP8 weights: the recipe's quantized math (``moeblaze_ops.fp8``):
    x's rows and act(h)'s in 1 x 128 tiles and the e4m3 weights, each dequantized in the
    accumulation dtype (one expert's weight at a time), so each GEMM multiplies exactly the
    quantized values; h is stored in x's dtype before its activation, as the FP8 kernels
    store it. Output in x's dtype."""
    acc = _acc_dtype(x.dtype)
    xq = fp8.dequantize_rows(*fp8.quantize_rows(x), acc)
    h = expert_up(xq, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed,
                  matrix=_fp8_matrix(w_gate_up_scale), dtype=x.dtype)
    a = _activated(h, activation, alpha, limit, interleaved)
    aq = fp8.dequantize_rows(*fp8.quantize_rows(a), acc)
    return _down_projection(aq, x.dtype, w_down, expert_offsets, token_index_map, topk_weights, b_down, transposed,
                            matrix=_fp8_matrix(w_down_scale))


def _fp8_matrix(scale):
    """``_matrix`` of an e4m3 weight stack whose 128 x 128 blocks have ``scale``: expert e's
    weight dequantized, as [in, out] in ``acc``."""
    def matrix(w, e, transposed, acc):
        return expert_matrix(fp8.dequantize_blocks(w[e:e + 1], scale[e:e + 1], acc), 0, transposed)

    return matrix


def expert_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map,
                         topk_weights, b_down, activation, transposed, interleaved, alpha, limit, in_place=False,
                         need_weight_grad=True):
    """``in_place`` writes dH over ``h`` and returns h as grad_h (each expert's rows of h
    are read before they are overwritten; sentinel rows of h are zero, as expert_up
    writes them, and so is their gradient). Without ``need_weight_grad`` the weight and
    bias gradients are returned empty."""
    acc = _acc_dtype(h.dtype)
    L, K = topk_weights.shape
    rw = row_weights(token_index_map, topk_weights, acc)
    grad_h = h if in_place else torch.zeros_like(h)
    grad_w = torch.zeros(w_down.shape if need_weight_grad else (0,), dtype=acc, device=h.device)
    grad_b = torch.zeros(b_down.shape if b_down is not None and need_weight_grad else (0,), dtype=acc,
                         device=h.device)
    # dL/dw for routed row r is <grad_out[token], y_r> = <grad_out[token] @ W^T, a_r> + <grad_out[token], b>.
    row_dot = torch.zeros(h.shape[0], dtype=acc, device=h.device)
    for e, s, t in _expert_ranges(expert_offsets):
        go = _gather_rows(grad_out, expert_token_indices, s, t, acc)
        W = _matrix(w_down, e, transposed, acc)
        g = go @ W.t()
        a, grad_h_e = activation_backward(h[s:t].to(acc), g * rw[s:t, None], activation, alpha, limit,
                                          interleaved)
        grad_h[s:t] = grad_h_e
        row_dot[s:t] = (g * a).sum(-1)
        if need_weight_grad:
            weighted = go * rw[s:t, None]
            _store_weight_grad(grad_w, e, a.t() @ weighted, transposed)
            if b_down is not None:
                grad_b[e] = weighted.sum(0)
        if b_down is not None:
            row_dot[s:t] += go @ b_down[e].to(acc)
    grad_topk_weights = row_dot[token_index_map.long()].view(L, K)
    return (grad_h, grad_w.to(w_down.dtype),
            grad_b.to(b_down.dtype if b_down is not None else h.dtype),
            grad_topk_weights.to(topk_weights.dtype))


def expert_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                       has_bias, transposed, need_input_grad=True, need_weight_grad=True):
    acc = _acc_dtype(x.dtype)
    E = w_gate_up.shape[0]
    N = grad_h.shape[1]
    grad_rows = torch.zeros(grad_h.shape[0] if need_input_grad else 0, x.shape[1], dtype=acc, device=x.device)
    grad_w = torch.zeros(w_gate_up.shape if need_weight_grad else (0,), dtype=acc, device=x.device)
    grad_b = torch.zeros((E, N) if has_bias and need_weight_grad else (0,), dtype=acc, device=x.device)
    for e, s, t in _expert_ranges(expert_offsets):
        dh = grad_h[s:t].to(acc)
        if need_input_grad:
            grad_rows[s:t] = dh @ _matrix(w_gate_up, e, transposed, acc).t()
        if need_weight_grad:
            _store_weight_grad(grad_w, e, _gather_rows(x, expert_token_indices, s, t, acc).t() @ dh, transposed)
            if has_bias:
                grad_b[e] = dh.sum(0)
    grad_x = combine(grad_rows, token_index_map, x.shape[0]) if need_input_grad else x.new_empty(0)
    return grad_x.to(x.dtype), grad_w.to(w_gate_up.dtype), grad_b.to(x.dtype)
