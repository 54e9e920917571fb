"""The two layouts of the expert weights, decoded in one place.

Both expert weights are a stack of E linear maps from ``in_features`` to
``out_features``: the up projection maps d -> N (N = 2I for gated activations), the
down projection I -> d. HF's layout (``transposed=False``) stores each map as
``nn.Linear`` does, ``[E, out, in]``; the transposed layout stores ``[E, in, out]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LinearDims(NamedTuple):
    """(experts, out_features, in_features) of a stack of expert weights."""

    experts: int
    out_features: int
    in_features: int


class LinearStrides(NamedTuple):
    """Strides of a stack of expert weights along (expert, in_features, out_features):
    the reduction dimension of ``x @ W`` and its output dimension."""

    expert: int
    reduction: int
    output: int


def linear_dims(w: torch.Tensor, transposed: bool) -> LinearDims:
    """(E, out, in) of ``w``: ``[E, out, in]``, or ``[E, in, out]`` when ``transposed``."""
    E, a, b = w.shape
    return LinearDims(E, b, a) if transposed else LinearDims(E, a, b)


def linear_strides(w: torch.Tensor, transposed: bool) -> LinearStrides:
    """Strides of ``w`` along (expert, in, out), whatever the layout."""
    se, sa, sb = w.stride()
    return LinearStrides(se, sa, sb) if transposed else LinearStrides(se, sb, sa)


def expert_matrix(w: torch.Tensor, e: int, transposed: bool) -> torch.Tensor:
    """Expert ``e``'s map as an ``[in, out]`` matrix (a view), so that ``y = x @ W``."""
    return w[e] if transposed else w[e].t()


def out_feature_slice(w: torch.Tensor, start: int, stop: int, transposed: bool) -> torch.Tensor:
    """The view of ``w`` restricted to output features ``[start, stop)``."""
    return w[:, :, start:stop] if transposed else w[:, start:stop]


def in_feature_slice(w: torch.Tensor, start: int, stop: int, transposed: bool) -> torch.Tensor:
    """The view of ``w`` restricted to input features ``[start, stop)``."""
    return w[:, start:stop] if transposed else w[:, :, start:stop]
