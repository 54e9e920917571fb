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
    E = w_gate_up.shape[0]
    L, K = topk_ids.shape
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
    ys = ys * topk_weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
    out = torch.zeros_like(x)
    return out.index_add(0, src_tok, ys)
