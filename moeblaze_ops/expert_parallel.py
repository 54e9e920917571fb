"""Expert parallelism over ``torch.distributed``: the experts layer with each rank holding
E/N of the experts ("all_to_all" mode: NCCL across nodes, gloo on CPU).

Rank r holds the experts ``[r * E_local, (r + 1) * E_local)``. For the tokens of this rank:

1. ``dispatch`` groups the routed rows by global expert, which is also destination-rank
   order: the rows for rank r are one contiguous range, no sort.
2. The per-rank row counts are exchanged on the device (an all-to-all of N integers), then
   read to the host once: the layer's only host sync, as late as possible (the split sizes
   of the token all-to-all are host integers in torch.distributed).
3. The routed token rows, and each row's local expert, go to their ranks (all-to-all).
4. Each rank runs ``moe_experts`` on what it received, one row per "token" (K = 1, weight
   1), grouping the rows by local expert with its own index arrays: the received rows,
   rank-major, are gathered inside the up GEMM, never reordered by a copy.
5. The expert outputs go back (the reverse all-to-all), in the order they were sent.
6. Each token's K rows are combined with the router weights in the order k = 0..K-1: the
   result is bitwise deterministic. Sentinel ids (>= E) contribute nothing.

Every step is differentiable (the all-to-alls' gradients are the reverse all-to-alls; the
row gather and the combine have deterministic backward passes of their own), so
``out.backward()`` gives the input, router and local expert-weight gradients.

transformers models reach it through ``DistributedConfig(ep_implementation="moeblaze")``
(``moeblaze_ops.hf_expert_parallel``). ``torch.compile(moe_experts_ep, fullgraph=True)``
works with ``torch._dynamo.config.capture_scalar_outputs = True`` (the split sizes become
sizes the graph learns at run time). Not yet here: the sync-free "symm" mode over CUDA symmetric memory.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from .checks import fail
from .functional import moe_experts
from .kernels.torch_backend.experts import combine, row_weights

__all__ = ["moe_experts_ep", "dispatch_to_experts", "combine_from_experts", "Exchange"]


class Exchange(NamedTuple):
    """What ``combine_from_experts`` needs to bring one layer's expert outputs home."""

    expert_token_indices: Tensor  # [L*K] int32, this rank's routed rows by global expert
    token_index_map: Tensor  # [L*K] int32
    topk_weights: Tensor  # [L, K]
    send_sizes: list  # rows sent to each rank
    recv_sizes: list  # rows received from each rank
    group: dist.ProcessGroup


def dispatch_to_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_local_experts: int,
                        group: Optional[dist.ProcessGroup] = None) -> tuple[Tensor, Tensor, Exchange]:
    """Sends this rank's routed rows to the ranks of their experts.

    Returns ``(rows, local_expert, exchange)``: the rows this rank's experts must run
    (``[R, d]``, grouped by source rank, then by expert), each row's local expert id
    (``[R]`` int32), and the state ``combine_from_experts`` takes. One host sync (the split
    sizes). Differentiable in ``x``.
    """
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    op = "moe_experts_ep"
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        fail(op, "topk_ids", f"and topk_weights must be [L, K] for x [L, d] = {tuple(x.shape)}, got "
             f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    eti, offsets, tim = torch.ops.moeblaze.dispatch(topk_ids, num_local_experts * world)
    # Rows for rank r: [offsets[r * E_local], offsets[(r + 1) * E_local]).
    bounds = offsets[::num_local_experts].to(torch.int64)
    send_counts = bounds[1:] - bounds[:-1]
    recv_counts = funcol.all_to_all_single(send_counts, None, None, group)
    sizes = torch.cat([send_counts, recv_counts]).tolist()  # the layer's one host sync
    send_sizes, recv_sizes = sizes[:world], sizes[world:]
    sent = sum(send_sizes)

    send_rows = _GatherRows.apply(x, eti, tim, sent)
    # Each sent row's expert, local to its destination rank.
    expert = torch.searchsorted(offsets[1:], torch.arange(sent, device=x.device, dtype=torch.int32), right=True)
    send_expert = (expert % num_local_experts).to(torch.int32)
    rows = funcol.all_to_all_single_autograd(send_rows, recv_sizes, send_sizes, group)
    local_expert = funcol.all_to_all_single(send_expert, recv_sizes, send_sizes, group)
    return rows, local_expert, Exchange(eti, tim, topk_weights, send_sizes, recv_sizes, group)


def combine_from_experts(expert_rows: Tensor, exchange: Exchange) -> Tensor:
    """Brings the experts' outputs (``[R, d]``, in the order ``dispatch_to_experts`` delivered
    the rows) back to their ranks and combines each token's K rows with its router weights,
    in the order k = 0..K-1. Differentiable in ``expert_rows`` and the router weights."""
    back = funcol.all_to_all_single_autograd(expert_rows, exchange.send_sizes, exchange.recv_sizes, exchange.group)
    return _CombineRows.apply(back, exchange.expert_token_indices, exchange.token_index_map, exchange.topk_weights,
                              exchange.topk_weights.shape[0])


def moe_experts_ep(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
                   activation: str = "swiglu", *, group: Optional[dist.ProcessGroup] = None, **options) -> Tensor:
    """``moe_experts`` with the experts spread over the ranks of ``group`` (default: the world).

    ``x [L, d]``, ``topk_ids [L, K]`` (global expert ids in ``[0, E)``, ``E = E_local * N``;
    ids ``>= E`` are sentinels) and ``topk_weights [L, K]`` are this rank's tokens (L may
    differ between ranks, and be 0). ``w_gate_up``, ``w_down`` (and the biases) hold this
    rank's ``E_local`` experts, the same count on every rank, in ``moe_experts``'s layouts;
    ``options`` are ``moe_experts``'s keyword arguments (biases, layout flags, ``alpha``,
    ``limit``, ``recompute``). Returns ``[L, d]``, differentiable in ``x``, ``topk_weights``
    and the local weights. One host sync per call (the split sizes of the token all-to-all).
    """
    rows, local_expert, exchange = dispatch_to_experts(x, topk_ids, topk_weights, w_gate_up.shape[0], group)
    # The received rows, one per "token", through this rank's experts (K = 1, weight 1).
    ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    expert_rows = moe_experts(rows, local_expert[:, None], ones, w_gate_up, w_down, activation, **options)
    return combine_from_experts(expert_rows, exchange)


def _first_rows(t: Tensor, n) -> Tensor:
    """``t[:n]``, written as a gather so that under torch.compile, where ``n`` may be a size
    known only at run time, the result's size is ``n`` itself (a slice would make a new one)."""
    if isinstance(t.shape[0], int) and t.shape[0] == 0:
        # A rank without tokens sends nothing; Inductor cannot lower a gather from nothing.
        torch._check(n == 0)
        return t
    return t.index_select(0, torch.arange(n, device=t.device))


def _padded_rows(rows: Tensor, total, dtype) -> Tensor:
    """``rows`` followed by zero rows up to ``total`` rows, in ``dtype``."""
    torch._check(rows.shape[0] <= total)
    return torch.cat([rows.to(dtype), rows.new_zeros(total - rows.shape[0], rows.shape[1], dtype=dtype)])


def _accumulation(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


class _GatherRows(torch.autograd.Function):
    """``x[expert_token_indices[:sent]]``: the routed rows to send. Backward sums each
    token's rows in the order k = 0..K-1 (deterministic, no scatter-add)."""

    @staticmethod
    def forward(ctx, x, eti, tim, sent):
        ctx.save_for_backward(tim)
        ctx.num_tokens = x.shape[0]
        return x.index_select(0, _first_rows(eti, sent).long())

    @staticmethod
    def backward(ctx, grad_rows):
        (tim,) = ctx.saved_tensors
        rows = _padded_rows(grad_rows, tim.shape[0], _accumulation(grad_rows.dtype))  # sentinels: no gradient
        return combine(rows, tim, ctx.num_tokens).to(grad_rows.dtype), None, None, None


class _CombineRows(torch.autograd.Function):
    """out[i] = sum over k = 0..K-1 of w[i, k] * rows[tim[i*K+k]], rows past ``rows.shape[0]``
    (sentinels) adding nothing, in fp32 for 16-bit rows."""

    @staticmethod
    def forward(ctx, rows, eti, tim, topk_weights, num_tokens):
        ctx.save_for_backward(rows, eti, tim, topk_weights)
        padded = _padded_rows(rows, tim.shape[0], _accumulation(rows.dtype))
        return combine(padded, tim, num_tokens, topk_weights, num_real_rows=rows.shape[0]).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        rows, eti, tim, topk_weights = ctx.saved_tensors
        acc = _accumulation(rows.dtype)
        sent = rows.shape[0]
        grad_rows = grad_tw = None
        if ctx.needs_input_grad[0]:
            # Each sent row belongs to one (token, k): its gradient is that token's, weighted.
            weight = _first_rows(row_weights(tim, topk_weights, acc), sent)[:, None]
            grad_rows = (grad_out.to(acc).index_select(0, _first_rows(eti, sent).long()) * weight).to(rows.dtype)
        if ctx.needs_input_grad[3]:
            # <g[i], rows[tim[i*K+k]]> for the real rows; sentinels pick an appended zero row
            # (no branch on the row count: under torch.compile it is known at run time only).
            L, K = topk_weights.shape
            pos = tim.long().view(L, K)
            real = pos < sent
            padded = torch.cat([rows.to(acc), rows.new_zeros(1, rows.shape[1], dtype=acc)])
            picked = padded.index_select(0, torch.where(real, pos, sent).flatten())
            dots = (picked.view(L, K, rows.shape[1]) * grad_out.to(acc)[:, None, :]).sum(-1)
            grad_tw = torch.where(real, dots, 0.0).to(topk_weights.dtype)
        return grad_rows, None, None, grad_tw, None
