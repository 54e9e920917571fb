"""transformers' ``DistributedConfig(ep_implementation="moeblaze")``: expert parallelism for
HF MoE models through moeblaze's token exchange (``moeblaze_ops.expert_parallel``).

transformers (5.19 and later) brings the experts of an ``ep_dispatch_experts`` module their
tokens through the ``EPImplementation`` its ``DistributedConfig`` names. ``MoeblazeEP``
replaces the argsort and scatter of transformers' own all-to-all implementation with
moeblaze's dispatch (destination-rank order without a sort) and a combine over K in a
fixed order, and runs the module's own experts forward (any ``experts_implementation``;
``"moeblaze"`` is the one it is built for) on the rows each rank receives. Importing
``moeblaze_ops`` registers it as soon as transformers loads its expert-parallel module.
"""

from __future__ import annotations

import torch
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface

from .expert_parallel import combine_from_experts, dispatch_to_experts

NAME = "moeblaze"


class MoeblazeEP(EPImplementation):
    """Each rank's (token, expert) pairs go to the experts' ranks and come back with two
    all-to-alls; one host sync per layer (the split sizes). The ranks of the EP group hold
    different batches; a TP group sharing one batch (``tp_size > 1``) is not supported yet."""

    def __init__(self, experts, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        if tp_mesh.size() > 1:
            raise NotImplementedError(f'ep_implementation="{NAME}" runs with tp_size=1 (each rank its own batch); '
                                      'use "all_to_all" with tensor parallelism')

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        rows, local_expert, exchange = dispatch_to_experts(hidden_states, top_k_index, top_k_weights,
                                                           self.num_local_experts, self.ep_mesh.get_group())
        # The experts run top-1 with unit weights; the router weights are applied at home.
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        expert_rows = self.experts_forward(rows, local_expert[:, None].long(), ones)
        return combine_from_experts(expert_rows, exchange)


def register() -> None:
    """Adds ``"moeblaze"`` to transformers' ``EPImplementationInterface`` (idempotent)."""
    EPImplementationInterface.register(NAME, MoeblazeEP)


register()
