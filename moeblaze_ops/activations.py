"""The expert activations: their names, their math and their derivatives.

One home for the activation math of the PyTorch kernels. ``h`` is the output of the up
projection in the weight's own column order: for gated activations its last dimension
holds 2I columns, either concatenated (all gate columns, then all up columns: HF's
``gate_up_proj[E, 2I, d]``) or interleaved (gate0, up0, gate1, up1, ...: GPT-OSS).

The functions compute in the dtype they are given; callers upcast half-precision inputs
to float32 first.
"""

from __future__ import annotations

import enum
import math

import torch

__all__ = [
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "ActivationCode",
    "CLAMPED_SWIGLU_ALPHA",
    "CLAMPED_SWIGLU_LIMIT",
    "clamped_swiglu_defaults",
    "activation_code",
    "is_gated",
    "activation_forward",
    "activation_backward",
]

#: Gated activations: ``h`` has 2I columns, the result I.
GATED_ACTIVATIONS = ("swiglu", "geglu", "clamped_swiglu")
#: Every activation name the ops accept. ``clamped_swiglu`` is GPT-OSS's gate:
#: ``(clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, limit)``.
ACTIVATIONS = GATED_ACTIVATIONS + ("silu", "gelu", "relu")


def clamped_swiglu_defaults() -> tuple[float, float]:
    """GPT-OSS's ``(alpha, limit)``, the defaults of every ``alpha``/``limit`` argument (only
    ``clamped_swiglu`` reads them). Returned as literals: torch.compile turns a float it
    reads from a module global into a symbol, and literals into constants."""
    return 1.702, 7.0


CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT = clamped_swiglu_defaults()


class ActivationCode(enum.IntEnum):
    """The activations as the Triton kernels take them (a constexpr argument). The gated
    ones come first: a code is gated exactly when it is below ``SILU``."""

    SWIGLU = 0
    GEGLU = 1
    CLAMPED_SWIGLU = 2
    SILU = 3
    GELU = 4
    RELU = 5


def activation_code(activation: str) -> ActivationCode:
    """The kernel code of an activation name."""
    return ActivationCode[activation.upper()]

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def is_gated(activation: str) -> bool:
    """True when ``activation`` multiplies a gate half by an up half (h has 2I columns)."""
    return activation in GATED_ACTIVATIONS


def _split(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return h[..., 0::2], h[..., 1::2]
    half = h.shape[-1] // 2
    return h[..., :half], h[..., half:]


def _merge(dg: torch.Tensor, du: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((dg, du), dim=-1).flatten(-2)
    return torch.cat((dg, du), dim=-1)


def _silu_and_grad(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(g)
    return g * s, s * (1 + g * (1 - s))


def _gelu_and_grad(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Exact (erf) GELU: d/dg [g * Phi(g)] = Phi(g) + g * phi(g).
    cdf = 0.5 * (1 + torch.erf(g * _INV_SQRT2))
    pdf = _INV_SQRT_2PI * torch.exp(-0.5 * g * g)
    return g * cdf, cdf + g * pdf


def _gate_and_grad(activation, g, u, alpha, limit):
    """Returns (a, da/dg, da/du) of a gated activation."""
    if activation == "swiglu":
        f, df = _silu_and_grad(g)
        return f * u, df * u, f
    if activation == "geglu":
        f, df = _gelu_and_grad(g)
        return f * u, df * u, f
    # clamped_swiglu; the clamps pass gradient on their closed intervals, as torch.clamp does.
    gc = g.clamp(max=limit)
    uc = u.clamp(min=-limit, max=limit)
    s = torch.sigmoid(alpha * gc)
    glu = gc * s
    dglu = s * (1 + alpha * gc * (1 - s))
    return (uc + 1) * glu, (uc + 1) * dglu * (g <= limit), glu * ((u >= -limit) & (u <= limit))


def _plain_and_grad(activation, h):
    if activation == "silu":
        return _silu_and_grad(h)
    if activation == "gelu":
        return _gelu_and_grad(h)
    return torch.relu(h), (h > 0).to(h.dtype)


def activation_forward(
    h: torch.Tensor, activation: str, alpha: float, limit: float, interleaved: bool
) -> torch.Tensor:
    """The activated rows ``a`` ([..., I]) of the up-projection output ``h``."""
    if is_gated(activation):
        g, u = _split(h, interleaved)
        if activation == "clamped_swiglu":
            gc = g.clamp(max=limit)
            return (u.clamp(min=-limit, max=limit) + 1) * gc * torch.sigmoid(alpha * gc)
        f = torch.nn.functional.silu(g) if activation == "swiglu" else _gelu_and_grad(g)[0]
        return f * u
    return _plain_and_grad(activation, h)[0]


def activation_backward(
    h: torch.Tensor,
    grad_a: torch.Tensor,
    activation: str,
    alpha: float,
    limit: float,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recomputes ``a`` from ``h`` and returns ``(a, grad_h)`` given ``grad_a = dL/da``."""
    if is_gated(activation):
        g, u = _split(h, interleaved)
        a, da_dg, da_du = _gate_and_grad(activation, g, u, alpha, limit)
        return a, _merge(grad_a * da_dg, grad_a * da_du, interleaved)
    a, da_dh = _plain_and_grad(activation, h)
    return a, grad_a * da_dh
