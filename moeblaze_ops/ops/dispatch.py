"""``moeblaze::dispatch``: the routing as three small int32 index arrays."""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import check_dispatch
from ..kernels import forward_backend
from . import define


def _dispatch(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Groups the routed rows by expert without copying any token.

    Args:
        topk_ids: ``[L, K]`` int32 or int64, the experts each token chose. No id may be
            negative or repeat in a row. Ids ``>= num_experts`` are sentinels (expert
            parallelism marks tokens owned by another rank so): they contribute nothing.
        num_experts: E.

    Returns:
        ``(expert_token_indices, expert_offsets, token_index_map)``, all int32:

        - ``expert_token_indices[L*K]``: token ids grouped by expert, experts ascending,
          tokens ascending inside each expert (the order a stable sort gives); the
          sentinel rows follow the last expert, in flat ``(token, k)`` order.
        - ``expert_offsets[E+1]``: exclusive prefix sum of the per-expert row counts;
          expert e owns rows ``[expert_offsets[e], expert_offsets[e+1])`` and
          ``expert_offsets[E]`` counts the real (non-sentinel) rows.
        - ``token_index_map[i*K+k]``: the row, in expert order, of token i's k-th choice
          (the inverse permutation of the grouping).
    """
    check_dispatch(topk_ids, num_experts)
    return forward_backend(topk_ids).dispatch(topk_ids, num_experts)


def dispatch_like(topk_ids, num_experts):
    """Empty tensors shaped as ``dispatch``'s outputs, after its argument checks (the fake
    functions)."""
    check_dispatch(topk_ids, num_experts)
    rows = topk_ids.shape[0] * topk_ids.shape[1]
    return (
        topk_ids.new_empty(rows, dtype=torch.int32),
        topk_ids.new_empty(num_experts + 1, dtype=torch.int32),
        topk_ids.new_empty(rows, dtype=torch.int32),
    )


#: ``torch.ops.moeblaze.dispatch`` (integer outputs: no autograd formula).
dispatch = define("dispatch(Tensor topk_ids, SymInt num_experts) -> (Tensor, Tensor, Tensor)", _dispatch,
                  dispatch_like, _dispatch.__doc__)
