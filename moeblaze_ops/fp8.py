"""FP8 (e4m3) formats of the DeepSeek-V3 recipe: activations in 1 x 128 tiles, weights in
128 x 128 blocks, one fp32 scale per tile or block.

A quantized tensor is a ``Quantized(q, scale)`` pair: ``q`` in ``torch.float8_e4m3fn`` with
the tensor's own shape, and ``scale`` in fp32 with one entry per tile (``quantize_rows``:
``[..., d / 128]``) or block (``quantize_blocks``: ``[..., N / 128, K / 128]``), such that
``q * scale``, each scale spread over its tile, is the tensor again up to e4m3's rounding
(``dequantize_rows``, ``dequantize_blocks``). A tile's scale maps its largest magnitude to
e4m3's largest finite value (448), so the tile uses e4m3's whole range and nothing
saturates. The block scales are what HF's fine-grained FP8 checkpoints (DeepSeek-V3,
Qwen3 FP8) store as ``weight_scale_inv`` next to each e4m3 weight: the factor that
dequantizes, the inverse of the one quantization multiplies by.

A GEMM on these formats accumulates in fp32 over each 128-wide block of its reduction and
applies the two scales per block: ``sum over blocks b of (q_x[:, b] @ q_w[:, b]^T) *
scale_x[:, b] * scale_w[n-block, b]``, which is ``dequantize_rows(x) @
dequantize_blocks(w)^T`` up to the order of the sums.

Widths must be multiples of the tile (128): a width that is not (GPT-OSS's d = 2880) is
refused with a ``ValueError`` that says how far to pad it. Pure torch: these run on any
device, and are the reference the FP8 kernels are tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

#: The element type: 4 exponent bits, 3 mantissa bits, no infinities.
E4M3 = torch.float8_e4m3fn
#: e4m3's largest finite value: a tile's largest magnitude maps to it.
E4M3_MAX = torch.finfo(E4M3).max
#: The tile width along a reduction, and the side of a weight block.
BLOCK = 128


class Quantized(NamedTuple):
    """An e4m3 tensor and its fp32 scales (one per tile or block; see the module docstring)."""

    q: Tensor
    scale: Tensor


def check_blocked_width(name: str, width: int, block: int = BLOCK) -> None:
    """Raises a ``ValueError`` naming ``name`` unless ``width`` is a multiple of ``block``."""
    if width % block:
        padded = -(-width // block) * block
        raise ValueError(f"moeblaze fp8: {name} = {width} is not a multiple of {block}, the FP8 tile width; "
                         f"pad it to {padded} (zeros) or run this layer in bf16")


def _check_floating(name: str, t: Tensor) -> None:
    if not t.is_floating_point() or t.dtype == E4M3:
        raise TypeError(f"moeblaze fp8: {name} must be a floating-point tensor to quantize, got {t.dtype}")


def _tile_scales(amax: Tensor) -> Tensor:
    """The scale of each tile from its largest magnitude: amax / 448, and 1 for an all-zero
    tile (its e4m3 values are zeros whatever the scale; 0 / 0 would make them NaN)."""
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _to_e4m3(scaled: Tensor) -> Tensor:
    # Scaled values lie within +-448 but for fp32 rounding of x / scale at the edge; e4m3fn
    # has no infinity, and a value past 448 would round to NaN.
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(x: Tensor, block: int = BLOCK) -> Quantized:
    """``x [..., d]`` in 1 x ``block`` tiles along its last dimension: ``q [..., d]`` (e4m3)
    and ``scale [..., d / block]`` (fp32). The activations' format (tokens' rows, and the
    rows of act(h) before the down GEMM)."""
    _check_floating("x", x)
    check_blocked_width("the rows' width", x.shape[-1], block)
    tiles = x.float().unflatten(-1, (x.shape[-1] // block, block))
    scale = _tile_scales(tiles.abs().amax(-1))
    return Quantized(_to_e4m3(tiles / scale[..., None]).flatten(-2), scale)


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale`` of ``quantize_rows``'s pair, in ``dtype`` (computed in fp32, or in
    float64 where ``dtype`` is: then every product is exact)."""
    _check_pair(q, scale, 1)
    wide = torch.promote_types(torch.float32, dtype)  # float64 asked for: exact products
    tiles = q.to(wide).unflatten(-1, (scale.shape[-1], q.shape[-1] // scale.shape[-1]))
    return (tiles * scale.to(wide)[..., None]).flatten(-2).to(dtype)


def quantize_blocks(w: Tensor, block: int = BLOCK) -> Quantized:
    """``w [..., N, K]`` (a weight, or a stack of experts' weights) in ``block`` x ``block``
    blocks over its last two dimensions: ``q [..., N, K]`` (e4m3) and ``scale [..., N /
    block, K / block]`` (fp32: a checkpoint's ``weight_scale_inv``)."""
    _check_floating("w", w)
    if w.dim() < 2:
        raise ValueError(f"moeblaze fp8: a weight has at least 2 dimensions, got shape {tuple(w.shape)}")
    n, k = w.shape[-2:]
    check_blocked_width("the weight's rows", n, block)
    check_blocked_width("the weight's columns", k, block)
    blocks = w.float().unflatten(-1, (k // block, block)).unflatten(-3, (n // block, block))  # [..., n/b, b, k/b, b]
    scale = _tile_scales(blocks.abs().amax(dim=(-3, -1)))
    q = _to_e4m3(blocks / scale[..., :, None, :, None])
    return Quantized(q.flatten(-2).flatten(-3, -2), scale)


def dequantize_blocks(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale`` of ``quantize_blocks``'s pair (or a checkpoint's e4m3 weight and its
    ``weight_scale_inv``), in ``dtype`` (computed as ``dequantize_rows`` computes)."""
    _check_pair(q, scale, 2)
    n_blocks, k_blocks = scale.shape[-2:]
    wide = torch.promote_types(torch.float32, dtype)
    blocks = q.to(wide).unflatten(-1, (k_blocks, q.shape[-1] // k_blocks))
    blocks = blocks.unflatten(-3, (n_blocks, q.shape[-2] // n_blocks))
    return (blocks * scale.to(wide)[..., :, None, :, None]).flatten(-2).flatten(-3, -2).to(dtype)


def _check_pair(q: Tensor, scale: Tensor, tiled_dims: int) -> None:
    """That ``scale`` holds one fp32 entry per tile of e4m3 ``q``'s last ``tiled_dims``
    dimensions, each tile of one width."""
    if q.dtype != E4M3:
        raise TypeError(f"moeblaze fp8: the quantized tensor must be {E4M3}, got {q.dtype}")
    if scale.dtype != torch.float32:
        raise TypeError(f"moeblaze fp8: scales must be float32, got {scale.dtype}")
    lead = q.dim() - tiled_dims
    fits = (scale.dim() == q.dim() and scale.shape[:lead] == q.shape[:lead]
            and all(s > 0 and n % s == 0 for s, n in zip(scale.shape[lead:], q.shape[lead:])))
    if fits and tiled_dims == 2:
        fits = q.shape[-2] // scale.shape[-2] == q.shape[-1] // scale.shape[-1]  # square blocks
    if not fits:
        raise ValueError(f"moeblaze fp8: scales of shape {tuple(scale.shape)} do not tile a quantized tensor of "
                         f"shape {tuple(q.shape)} ({'1 x b tiles' if tiled_dims == 1 else 'b x b blocks'})")
