"""The FP8 formats (``moeblaze_ops.fp8``): 1 x 128 activation tiles, 128 x 128 weight blocks."""

import pytest
import torch

from conftest import rel_err
from moeblaze_ops import fp8


def _random(shape, seed, spread=True):
    """Normal values whose magnitudes vary by orders of magnitude across the rows (every
    tile gets a scale of its own to find), on a fresh generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if spread:
        x = x * torch.exp(3 * torch.randn(*shape[:-1], 1, generator=g))
    return x


def _rounding_bound(x, tile_scale):
    """What e4m3 rounding may move each value by: half an ulp, 2^-4 of the value where it is
    normal in the tile's scale, and half the smallest subnormal (2^-10 x scale) below."""
    return torch.maximum(x.abs() * 2.0 ** -4, tile_scale * 2.0 ** -10) * (1 + 1e-6)


@pytest.mark.parametrize("shape", [(3, 128), (5, 384), (2, 3, 256)])
def test_rows_round_trip_within_one_rounding(shape, seed):
    x = _random(shape, seed)
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == fp8.E4M3 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (*shape[:-1], shape[-1] // 128)
    back = fp8.dequantize_rows(q, scale)
    per_value_scale = scale.repeat_interleave(128, dim=-1)
    assert ((back - x).abs() <= _rounding_bound(x, per_value_scale)).all()
    # Each tile's largest magnitude lands on e4m3's largest value: the whole range is used.
    tile_max = q.float().abs().unflatten(-1, (shape[-1] // 128, 128)).amax(-1)
    assert torch.equal(tile_max, torch.full_like(tile_max, fp8.E4M3_MAX))


def test_rows_scales_are_per_tile(seed):
    """Scales from each 1 x 128 tile alone: the tile's largest magnitude over 448."""
    x = _random((4, 512), seed)
    _, scale = fp8.quantize_rows(x)
    for r in range(4):
        for t in range(4):
            assert scale[r, t] == (x[r, 128 * t:128 * (t + 1)].abs().max() / fp8.E4M3_MAX).float()


@pytest.mark.parametrize("shape", [(256, 128), (3, 128, 384), (2, 2, 256, 256)])
def test_blocks_round_trip_within_one_rounding(shape, seed):
    w = _random(shape, seed)
    q, scale = fp8.quantize_blocks(w)
    n, k = shape[-2:]
    assert q.dtype == fp8.E4M3 and q.shape == w.shape
    assert scale.shape == (*shape[:-2], n // 128, k // 128)
    back = fp8.dequantize_blocks(q, scale)
    per_value_scale = scale.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
    assert ((back - w).abs() <= _rounding_bound(w, per_value_scale)).all()


def test_block_scales_are_the_checkpoint_layout(seed):
    """``scale[e, i, j]`` is the largest magnitude of expert e's block (rows 128i.., columns
    128j..) over 448: HF fine-grained FP8's ``weight_scale_inv``, which dequantizes by
    multiplying. Blocks of very different magnitudes, so a transposed or shifted layout shows."""
    E, N, K = 2, 256, 384
    magnitude = torch.arange(1, E * (N // 128) * (K // 128) + 1, dtype=torch.float32).reshape(E, N // 128, K // 128)
    w = _random((E, N, K), seed, spread=False) * (magnitude ** 2).repeat_interleave(128, 1).repeat_interleave(128, 2)
    q, scale = fp8.quantize_blocks(w)
    for e in range(E):
        for i in range(N // 128):
            for j in range(K // 128):
                block = w[e, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
                assert scale[e, i, j] == (block.abs().max() / fp8.E4M3_MAX).float()
                assert torch.allclose(q[e, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].float() * scale[e, i, j],
                                      block, rtol=2.0 ** -4, atol=float(scale[e, i, j]) * 2.0 ** -10)


def test_zero_tiles_stay_zero():
    """An all-zero tile or block quantizes to zeros with a finite scale (not 0 / 0)."""
    x = torch.zeros(2, 256)
    x[1, 128:] = torch.linspace(-3, 3, 128)
    q, scale = fp8.quantize_rows(x)
    assert torch.isfinite(scale).all() and not torch.isnan(q.float()).any()
    assert torch.equal(fp8.dequantize_rows(q, scale)[:, :128], x[:, :128])
    qw, sw = fp8.quantize_blocks(torch.zeros(128, 256))
    assert torch.isfinite(sw).all() and torch.equal(fp8.dequantize_blocks(qw, sw), torch.zeros(128, 256))


def test_blockwise_gemm_of_the_quantized_operands(seed):
    """The GEMM the FP8 kernels compute: per 128-wide block of the reduction, the e4m3
    product scaled by both scales, summed; equal in float64 to the product of the
    dequantized operands, and within 5e-2 of the unquantized product (random normal
    operands, one scale per token row's tile)."""
    M, N, K = 48, 256, 384
    x, w = _random((M, K), seed), _random((N, K), seed + 1, spread=False)
    (qx, sx), (qw, sw) = fp8.quantize_rows(x), fp8.quantize_blocks(w)
    blockwise = torch.zeros(M, N, dtype=torch.float64)
    for b in range(K // 128):
        part = qx[:, 128 * b:128 * (b + 1)].double() @ qw[:, 128 * b:128 * (b + 1)].double().T
        blockwise += part * sx[:, b, None].double() * sw[:, b].double().repeat_interleave(128)[None, :]
    dequantized = fp8.dequantize_rows(qx, sx, torch.float64) @ fp8.dequantize_blocks(qw, sw, torch.float64).T
    assert rel_err(blockwise, dequantized) < 1e-12
    assert rel_err(blockwise, x.double() @ w.double().T) < 5e-2


@pytest.mark.parametrize("width", [2880, 100, 130])
def test_widths_off_the_tile_are_refused(width):
    with pytest.raises(ValueError, match=rf"{width} is not a multiple of 128.*pad it to {-(-width // 128) * 128}"):
        fp8.quantize_rows(torch.randn(2, width))
    with pytest.raises(ValueError, match=rf"{width} is not a multiple of 128"):
        fp8.quantize_blocks(torch.randn(width, 256))
    with pytest.raises(ValueError, match=rf"{width} is not a multiple of 128"):
        fp8.quantize_blocks(torch.randn(256, width))


def test_bad_inputs_are_refused():
    with pytest.raises(TypeError, match="floating-point"):
        fp8.quantize_rows(torch.ones(2, 128, dtype=torch.int32))
    q, scale = fp8.quantize_rows(torch.randn(2, 256))
    with pytest.raises(TypeError, match="floating-point"):
        fp8.quantize_rows(q)  # already quantized
    with pytest.raises(TypeError, match="must be torch.float8_e4m3fn"):
        fp8.dequantize_rows(q.float(), scale)
    with pytest.raises(TypeError, match="float32"):
        fp8.dequantize_rows(q, scale.double())
    with pytest.raises(ValueError, match="do not tile"):
        fp8.dequantize_rows(q, scale[:, :1].repeat(1, 3))
    qw, sw = fp8.quantize_blocks(torch.randn(256, 384))
    with pytest.raises(ValueError, match="do not tile"):
        fp8.dequantize_blocks(qw, sw.T.contiguous())
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        fp8.quantize_blocks(torch.randn(256))


@pytest.mark.parametrize("activation,layout,bias", [("swiglu", "concatenated", False),
                                                    ("clamped_swiglu", "transposed_interleaved", True),
                                                    ("gelu", "transposed", False)])
def test_fp8_reference_layer(activation, layout, bias, seed):
    """``testing.reference_moe_fp8``, the FP8 recipe's layer in float64 (the reference the
    FP8 kernels will be held to), against the unquantized layer: an e4m3 rounding moves a
    random value by about 2.4% rms, and a path through the layer meets four quantized
    operands (x, W_gate_up, act(h), W_down; a gated activation multiplies two quantized
    columns), so the layer lands about 5-7% away: within 1e-1, and at least 1e-2 (its
    operands did go through e4m3). Each GEMM alone stays within 5e-2
    (``test_blockwise_gemm_of_the_quantized_operands``). h rounded to bf16 first moves it
    far less than the quantization does; a sentinel id still contributes nothing."""
    from moeblaze_ops.testing import make_layer, reference_moe, reference_moe_fp8

    layer = make_layer(24, 256, 128, 4, 2, dtype=torch.float64, activation=activation, layout=layout, bias=bias,
                       sentinel_frac=0.2, seed=seed)
    exact = reference_moe(**layer)
    quantized = reference_moe_fp8(**layer)
    err = rel_err(quantized, exact)
    assert 1e-2 < err < 1e-1
    rounded = reference_moe_fp8(**layer, h_dtype=torch.bfloat16)
    assert 0 < rel_err(rounded, quantized) < err / 2
    layer["topk_ids"][0] = 4  # token 0 routed to sentinels only
    assert torch.equal(reference_moe_fp8(**layer)[0], torch.zeros(256, dtype=torch.float64))
