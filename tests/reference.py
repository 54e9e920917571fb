"""An independent plain implementation of an MoE experts layer, written for the tests.

The sort-and-permute dropless MoE: flatten the (token, k) assignments, stable-argsort them
by expert, gather the token rows into a permuted [L*K, d] buffer, run each expert on its
slice, then scatter-add each weighted row back to its token. Activations come from
torch.nn.functional, not from moeblaze_ops. Differentiable through autograd.
"""

import torch
import torch.nn.functional as F


def reference_activation(h, activation, interleaved=False, alpha=1.702, limit=7.0):
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
    assert activation == "clamped_swiglu"
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def reference_moe(x, topk_ids, topk_weights, w_gate_up, w_down, activation="swiglu", *, b_gate_up=None,
                  b_down=None, transposed=False, interleaved=False, alpha=1.702, limit=7.0):
    """out[i] = sum_k topk_weights[i, k] * expert_{topk_ids[i, k]}(x[i]); ids >= E contribute nothing."""
    ys, order, src_tok = _routed_rows(x, topk_ids, w_gate_up, w_down, activation, b_gate_up, b_down, transposed,
                                      interleaved, alpha, limit)
    ys = ys * topk_weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
    out = torch.zeros_like(x)
    return out.index_add(0, src_tok, ys)


def router_grad_scale(grad_out, x, topk_ids, topk_weights, w_gate_up, w_down, activation="swiglu", *,
                      b_gate_up=None, b_down=None, transposed=False, interleaved=False, alpha=1.702, limit=7.0):
    """The root-sum-square of the terms of the router gradient's dot products,
    ``sqrt(sum over (i, k) and c of (grad_out[i, c] * y_ik[c])^2)``: the scale of its
    rounding error. (The gradient's own norm equals it on average over random data, but
    a few dot products, as with one token, can cancel to far less.)"""
    ys, _, src_tok = _routed_rows(x, topk_ids, w_gate_up, w_down, activation, b_gate_up, b_down, transposed,
                                  interleaved, alpha, limit)
    return (grad_out.index_select(0, src_tok).to(ys.dtype) * ys).norm()


def _routed_rows(x, topk_ids, w_gate_up, w_down, activation, b_gate_up, b_down, transposed, interleaved, alpha,
                 limit):
    """Each real routed row's expert output (unweighted), in expert order, with the
    (token, k) position it came from and its token."""
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
        a = reference_activation(hidden, activation, interleaved, alpha, limit)
        w2 = w_down[e] if transposed else w_down[e].t()
        y = a @ w2
        if b_down is not None:
            y = y + b_down[e]
        outs.append(y)
    ys = torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])
    return ys, order, src_tok
