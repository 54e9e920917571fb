"""Portable PyTorch kernel of ``moeblaze.dispatch``.

Defines the outputs bit for bit: every other dispatch kernel must agree with this one.
"""

from __future__ import annotations

import torch

from ...checks import check_topk_id_values


def dispatch(topk_ids: torch.Tensor, num_experts: int):
    """Index arrays of a routing; see ``moeblaze_ops.dispatch`` for their meaning."""
    check_topk_id_values("dispatch", topk_ids, num_experts)
    L, K = topk_ids.shape
    LK = L * K
    device = topk_ids.device
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    if LK == 0:
        empty = torch.empty(0, dtype=torch.int32, device=device)
        return empty, offsets, empty.clone()
    # Every sentinel (id >= E) becomes E, so sentinels sort after the last expert and keep
    # their flat order among themselves.
    key = topk_ids.reshape(-1).to(torch.int64).clamp(max=num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    offsets[1:] = counts.cumsum(0)
    expert_token_indices = torch.div(order, K, rounding_mode="floor").to(torch.int32)
    token_index_map = torch.empty(LK, dtype=torch.int32, device=device)
    token_index_map[order] = torch.arange(LK, dtype=torch.int32, device=device)
    return expert_token_indices, offsets, token_index_map
