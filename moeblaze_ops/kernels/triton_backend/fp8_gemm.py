"""The FP8 (e4m3) grouped GEMM of the DeepSeek-V3 recipe, in ``tl``, on the ``grouped_gemm`` core.

``out[r] = A[a_row_ids[r] or r] @ B_e (+ bias_e)`` for every routed row r of expert e, as
``experts._gathered_gemm_kernel`` computes it, with both operands quantized
(``moeblaze_ops.fp8``): A's rows in 1 x 128 tiles (the token rows of x quantized once,
gathered by index inside the operand load as the bf16 GEMM gathers them; no [L*K, d]
copy), B's expert weights in 128 x 128 blocks (a fine-grained FP8 checkpoint's weight and
its ``weight_scale_inv``). The reduction runs in steps of one 128-wide block, so each step
has one A scale per row and one B scale per column: the step's e4m3 product, accumulated
by the tensor cores in fp32, is scaled by both and added to an fp32 accumulator. The
output is in ``out``'s dtype (bf16 for the recipe); the sentinel group's rows are zeros.

``expert_layer_fp8`` is ``expert_layer`` on FP8 weights, made of it: x's rows quantized
once, the up GEMM, the activation pass, act(h)'s rows quantized, the down GEMM, the
combine. The quantizations are ``fp8.quantize_rows``'s torch operations for now (no host
sync; a pass each over x and act(h)).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ... import fp8
from ...activations import activation_code
from ...layouts import linear_dims, linear_strides
from .. import config
from . import grouped_gemm as gg
from ..launch import launch
from .combine import combine
from .experts import launch_activation


@triton.jit
def fp8_gathered_gemm_tile(
    tile, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, a_row_ids_ptr, offsets_ptr, LK, E, N, REDUCTION,
    stride_am, stride_ak, stride_asm, stride_be, stride_bk, stride_bn, stride_bse, stride_bsk, stride_bsn, stride_bias,
    GATHER_A: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, BAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    """(rows, row mask, columns, column mask, fp32 tile) of output tile ``tile`` (see the
    module docstring); B and its scales read as [E, REDUCTION, N] and [E, REDUCTION /
    SCALE_BLOCK, N / SCALE_BLOCK] through their strides."""
    e, row0, rows, rmask, n0, cols, cmask = gg.row_tile(tile, offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS, BAND)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if e < E:
        a_rows = gg.a_rows_of(a_row_ids_ptr, rows, rmask, GATHER_A)
        b_scales = b_scale_ptr + e.to(tl.int64) * stride_bse + (cols // SCALE_BLOCK) * stride_bsn
        for k0 in range(0, REDUCTION, SCALE_BLOCK):
            a = gg.load_rows(a_ptr, a_rows, rmask, k0, REDUCTION, stride_am, stride_ak, SCALE_BLOCK)
            b = gg.load_weight_tile(b_ptr, e, k0, n0, stride_be, stride_bk, stride_bn, REDUCTION, N, False, False,
                                    SCALE_BLOCK, BLOCK_N)
            step = k0 // SCALE_BLOCK
            a_scale = tl.load(a_scale_ptr + a_rows * stride_asm + step, mask=rmask, other=0.0)
            b_scale = tl.load(b_scales + step * stride_bsk, mask=cmask, other=0.0)
            # A step's product is exact in fp32 on e4m3 inputs but for its sums; the scales
            # differ from step to step, so each step's product is scaled on its own.
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        if HAS_BIAS:
            acc = gg.add_bias(acc, bias_ptr, e, stride_bias, cols, cmask)
    return rows, rmask, cols, cmask, acc


@triton.jit
def _fp8_gathered_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, a_row_ids_ptr, offsets_ptr, out_ptr,
    LK, E, N, REDUCTION,
    stride_am, stride_ak, stride_asm, stride_be, stride_bk, stride_bn, stride_bse, stride_bsk, stride_bsn, stride_bias,
    stride_om,
    GATHER_A: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, BAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    """The persistent loop over ``fp8_gathered_gemm_tile``'s tiles, each stored in ``out``'s dtype."""
    total = gg.num_row_tiles(offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        rows, rmask, cols, cmask, acc = fp8_gathered_gemm_tile(
            tile, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, a_row_ids_ptr, offsets_ptr, LK, E, N, REDUCTION,
            stride_am, stride_ak, stride_asm, stride_be, stride_bk, stride_bn, stride_bse, stride_bsk, stride_bsn, stride_bias,
            GATHER_A, HAS_BIAS, GROUPS, BAND, BLOCK_M, BLOCK_N, SCALE_BLOCK)
        gg.store_tile(out_ptr, rows, cols, stride_om, acc, rmask[:, None] & cmask[None, :])


def _check_operands(a, a_scale, b, b_scale, transposed):
    """That A and B are e4m3 with fp32 scales of the recipe's tiles and blocks, A's rows as
    wide as B's reduction; a ``TypeError`` or ``ValueError`` naming the operand otherwise."""
    for name, t in (("A", a), ("B", b)):
        if t.dtype != fp8.E4M3:
            raise TypeError(f"moeblaze fp8 GEMM: {name} must be {fp8.E4M3}, got {t.dtype}")
    for name, t in (("A's scales", a_scale), ("B's scales", b_scale)):
        if t.dtype != torch.float32:
            raise TypeError(f"moeblaze fp8 GEMM: {name} must be float32, got {t.dtype}")
    E, out_features, reduction = linear_dims(b, transposed)
    if a.shape[1] != reduction:
        raise ValueError(f"moeblaze fp8 GEMM: A's rows have {a.shape[1]} columns, B's reduction is {reduction}")
    fp8.check_blocked_width("the reduction", reduction)
    fp8.check_blocked_width("the output features", out_features)
    blocks = (E, out_features // fp8.BLOCK, reduction // fp8.BLOCK)
    if tuple(a_scale.shape) != (a.shape[0], reduction // fp8.BLOCK) or tuple(linear_dims(b_scale, transposed)) != blocks:
        raise ValueError(f"moeblaze fp8 GEMM: scales {tuple(a_scale.shape)} and {tuple(b_scale.shape)} do not tile "
                         f"A {tuple(a.shape)} in 1 x {fp8.BLOCK} and B {tuple(b.shape)} in {fp8.BLOCK} x {fp8.BLOCK}")


def launch_fp8_gathered_gemm(a, a_scale, a_row_ids, b, b_scale, bias, offsets, out, transposed=False):
    """out[r] = A[a_row_ids[r] or r] @ B_e (+ bias_e) over every routed row on e4m3
    operands (``_fp8_gathered_gemm_kernel``): ``a`` [rows, K] e4m3 with ``a_scale`` [rows,
    K / 128] (``fp8.quantize_rows``), ``b`` an expert weight stack in ``transposed`` layout
    ([E, out, in], or [E, in, out]) with ``b_scale`` its 128 x 128 blocks' scales in the same
    layout (``fp8.quantize_blocks`` of ``b``), ``out`` [L*K, out] in any float dtype. The
    tile is the up GEMM's, one scale block a reduction step."""
    _check_operands(a, a_scale, b, b_scale, transposed)
    E, _, reduction = linear_dims(b, transposed)
    LK, N = out.shape
    tile = dataclasses.replace(gg.tile_config("up", out, LK, E), block_k=fp8.BLOCK)
    strides, scale_strides = linear_strides(b, transposed), linear_strides(b_scale, transposed)
    max_tiles = (gg.cdiv(LK, tile.block_m) + E + 1) * gg.cdiv(N, tile.block_n)
    launch(_fp8_gathered_gemm_kernel, (gg.num_programs(out.device, max_tiles, tile.programs_per_sm),),
           a, a_scale, b, b_scale, bias, a_row_ids, offsets, out, LK, E, N, reduction,
           a.stride(0), a.stride(1), a_scale.stride(0), strides.expert, strides.reduction, strides.output,
           scale_strides.expert, scale_strides.reduction, scale_strides.output,
           bias.stride(0) if bias is not None else 0, out.stride(0),
           GATHER_A=a_row_ids is not None, HAS_BIAS=bias is not None, GROUPS=gg.next_power_of_2(E + 1),
           BAND=config.ROW_BAND, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, SCALE_BLOCK=fp8.BLOCK,
           num_warps=tile.num_warps, num_stages=tile.num_stages)


def expert_layer_fp8(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, expert_token_indices, expert_offsets,
                     token_index_map, topk_weights, b_gate_up, b_down, activation, transposed, interleaved, alpha,
                     limit):
    """``expert_layer`` on FP8 weights (see the module docstring): h and the output in x's
    dtype, the sentinel rows adding nothing."""
    L, LK = x.shape[0], expert_token_indices.shape[0]
    E, N, _ = linear_dims(w_gate_up, transposed)
    _, d, I = linear_dims(w_down, transposed)
    out = gg.empty(L, d, dtype=x.dtype, device=x.device)
    if LK == 0:
        return out.zero_()
    h = gg.empty(LK, N, dtype=x.dtype, device=x.device)
    launch_fp8_gathered_gemm(*fp8.quantize_rows(x), expert_token_indices, w_gate_up, w_gate_up_scale, b_gate_up,
                             expert_offsets, h, transposed)
    a = gg.empty(LK, I, dtype=x.dtype, device=x.device)
    launch_activation(h, a, activation_code(activation), interleaved, alpha, limit)
    y = gg.empty(LK, d, dtype=x.dtype, device=x.device)
    launch_fp8_gathered_gemm(*fp8.quantize_rows(a), None, w_down, w_down_scale, b_down, expert_offsets, y, transposed)
    return combine(y, token_index_map, topk_weights, expert_offsets, out, E)
