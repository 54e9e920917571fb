"""dH on Hopper (sm_90), in Gluon: the row GEMM's pipeline with the activation's backward as its epilogue.

The product and epilogue of ``triton_experts_backward._dh_kernel`` (the portable path):
for every routed row r of expert e, ``g = grad_out[token(r)] @ W_down_e^T`` over the
[BLOCK_M, BLOCK_N] tiles of ``gluon_row_gemm``'s schedule and ring (output-gradient rows
gathered by cp.async, the weight by TMA, copies running ahead across tile edges); then,
from the h tiles behind the tile's columns, ``(dL/dgate, dL/dup, a) =
triton_activations.backward(w * g, h)`` is written as dH (over h when asked), ``w * a``
(the down weight gradient's operand) and each row's router partial ``<g, a>``.

What the ``tl`` kernel cannot do: the tile's h (gate and up, 2 x [BLOCK_M, BLOCK_N]) is
requested by TMA when the tile starts and lands in its own shared memory while the MMAs
run, so the epilogue reads it from there instead of waiting on global loads after the
last MMA.

Applies where ``gluon_row_gemm`` applies to the GEMM (16-bit, Hopper, 16-element aligned
K, N and strides), h is contiguous with TMA-aligned rows, the layout is concatenated (gate
columns, then up) or the activation not gated, and the layer has no down bias; everything
else takes the portable kernel.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..layouts import linear_dims
from ..settings import GemmTile
from . import grouped_gemm as gg
from . import triton_activations as acts
from .gluon_common import cta_barrier, on_hopper, tma_load, wgmma_acc_layout
from .gluon_row_gemm import _first_copies, _ring, _row_tile, _schedule, _tile_steps, _weight_view
from .gluon_row_gemm import applies as row_gemm_applies
from .triton_combine import row_combine_weights

#: 128 x 128 outputs per program (2 warpgroups of 64 rows): the accumulator and the h tiles
#: the epilogue holds fit the registers; 4 ring slots of 32 KB plus 64 KB of h.
TILE = GemmTile(128, 128, 64, 8, 4)


@gluon.jit
def _dh_kernel(
    go_ptr, w_desc, h_desc, eti_ptr, tw_ptr, tim_ptr, offsets_ptr, dh_ptr, wact_ptr, part_ptr,
    LK, E, D, I, alpha, limit, n_parts,
    stride_gm, stride_dhm, stride_wam, stride_tw0, stride_tw1,
    K: gl.constexpr, ACT: gl.constexpr, W_KMAJOR: gl.constexpr, WRITE_WACT: gl.constexpr, FAST_ACT: gl.constexpr,
    GROUPS: gl.constexpr, BAND: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = go_ptr.dtype.element_ty
    acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_N, num_warps)
    GATED: gl.constexpr = ACT < acts.NUM_GATED
    a_ring, b_ring, bars = _ring(dtype, w_desc, NUM_STAGES, BLOCK_M, BLOCK_K)
    h_pair = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], h_desc.layout)
    h_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(h_bar, count=1)

    tile_end, n_tiles, k_steps, total = _schedule(offsets_ptr, E, LK, I, D, BLOCK_M, BLOCK_N, BLOCK_K, GROUPS,
                                                  num_warps)
    p_tile, p_k, p_grp, p_row0, p_end, p_n0, p_offs = _first_copies(
        go_ptr, w_desc, eti_ptr, offsets_ptr, a_ring, b_ring, bars, tile_end, n_tiles, k_steps, LK, E, D,
        stride_gm, True, W_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, BAND, num_warps)
    step = 0
    h_phase = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        grp, row0, row_end, n0 = _row_tile(tile, offsets_ptr, tile_end, E, LK, n_tiles, BLOCK_M, BLOCK_N, BAND)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        if grp < E:
            # Every thread is done reading the last tile's h from h_pair (a generic-proxy
            # read) before the copy engine overwrites it.
            fence_async_shared()
            cta_barrier()
            if GATED:
                mbarrier.expect(h_bar, 2 * h_desc.block_type.nbytes)
                tma_load(h_desc, [row0, n0], h_bar, h_pair.index(0))
                tma_load(h_desc, [row0, I + n0], h_bar, h_pair.index(1))
            else:
                mbarrier.expect(h_bar, h_desc.block_type.nbytes)
                tma_load(h_desc, [row0, n0], h_bar, h_pair.index(0))
            acc, step, p_tile, p_k, p_grp, p_row0, p_end, p_n0, p_offs = _tile_steps(
                acc, step, go_ptr, w_desc, eti_ptr, offsets_ptr, a_ring, b_ring, bars, tile_end, n_tiles,
                k_steps, p_tile, p_k, p_grp, p_row0, p_end, p_n0, p_offs, LK, E, D, stride_gm,
                True, W_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, BAND, num_warps)
            mbarrier.wait(h_bar, h_phase)
            h_phase ^= 1
            hg = h_pair.index(0).load(acc_layout)
            if GATED:
                hu = h_pair.index(1).load(acc_layout)
            else:
                hu = hg
        else:  # the sentinel rows: zeros everywhere (a zero gradient and a zero weight)
            hg = gl.zeros([BLOCK_M, BLOCK_N], dtype, acc_layout)
            hu = hg
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        rmask = rows < row_end
        real = rmask & (grp < E)
        tok = gl.load(eti_ptr + rows, mask=real, other=0).to(gl.int64)
        w = row_combine_weights(tw_ptr, tim_ptr, tok, rows, real, stride_tw0, stride_tw1, K)[:, None]
        dg, du, a = acts.backward(acc * w, hg, hu, alpha, limit, ACT, FAST_ACT)
        smask = rmask[:, None] & (cols < I)[None, :]
        out_rows = dh_ptr + rows.to(gl.int64)[:, None] * stride_dhm + cols[None, :]
        if GATED:
            dg = dg.to(dtype)
            du = du.to(dtype)
            gl.store(out_rows, dg, mask=smask)
            gl.store(out_rows + I, du, mask=smask)
        else:
            gl.store(out_rows, dg.to(dtype), mask=smask)
        if WRITE_WACT:
            gl.store(wact_ptr + rows.to(gl.int64)[:, None] * stride_wam + cols[None, :], (w * a).to(dtype),
                     mask=smask)
        # Rows past the expert's end hold the next expert's h, and columns past I the up
        # half: their activation is left out of the router partial.
        a = gl.where(smask, a, 0.0)
        gl.store(part_ptr + rows.to(gl.int64) * n_parts + n0 // BLOCK_N, gl.sum(acc * a, axis=1), mask=rmask)


def applies(grad_out: torch.Tensor, h: torch.Tensor, w_down: torch.Tensor, transposed: bool, gated: bool,
            interleaved: bool, has_bias: bool) -> bool:
    """Whether ``launch_dh`` handles these operands (else the portable kernel does)."""
    if has_bias or (gated and interleaved) or not on_hopper(h):
        return False
    _, _, I = linear_dims(w_down, transposed)
    fits_tma = (h.is_contiguous() and h.data_ptr() % 16 == 0 and (h.stride(0) * h.element_size()) % 16 == 0
                and (I * h.element_size()) % 16 == 0)
    # The GEMM: grad_out [L, d] @ W_down^T as [E, d, I], into I columns of rows as wide as h.
    return fits_tma and I % 16 == 0 and row_gemm_applies(grad_out, w_down, h[:, :I], not transposed)


def launch_dh(grad_out, h, w_down, eti, topk_weights, tim, offsets, grad_h, wact, parts, *, act, transposed, alpha,
              limit, fast_activation: bool, band: int, tile: GemmTile = TILE):
    """``triton_experts_backward.launch_dh`` without a bias, on this kernel: dH into
    ``grad_h`` (which may be ``h``), ``wact`` = w * act(h) unless None, the router
    partials into ``parts`` ([L*K, cdiv(I, tile.block_n)])."""
    if tile.block_m != 16 * tile.num_warps or tile.num_stages < 3:
        raise ValueError(f"moeblaze gluon dH: block_m must be 16 * num_warps and num_stages at least 3, got {tile}")
    LK = h.shape[0]
    E, d, I = linear_dims(w_down, transposed)
    if parts.shape[1] != triton.cdiv(I, tile.block_n):
        raise ValueError(f"moeblaze gluon dH: {parts.shape[1]} router partials per row for {I} columns in tiles "
                         f"of {tile.block_n}")
    view, kmajor = _weight_view(w_down, not transposed)
    gl_dtype = gl.bfloat16 if h.dtype == torch.bfloat16 else gl.float16
    w_block = [1, tile.block_n, tile.block_k] if kmajor else [1, tile.block_k, tile.block_n]
    w_desc = TensorDescriptor.from_tensor(view, w_block, gl.NVMMASharedLayout.get_default_for(w_block, gl_dtype))
    h_block = [tile.block_m, tile.block_n]
    h_desc = TensorDescriptor.from_tensor(h, h_block, gl.NVMMASharedLayout.get_default_for(h_block, gl_dtype))
    max_tiles = (triton.cdiv(LK, tile.block_m) + E + 1) * triton.cdiv(I, tile.block_n)
    _dh_kernel[(gg.num_programs(h.device, max_tiles),)](
        grad_out, w_desc, h_desc, eti, topk_weights, tim, offsets, grad_h, wact, parts,
        LK, E, d, I, float(alpha), float(limit), parts.shape[1],
        grad_out.stride(0), grad_h.stride(0), wact.stride(0) if wact is not None else 0,
        topk_weights.stride(0), topk_weights.stride(1),
        K=topk_weights.shape[1], ACT=act, W_KMAJOR=kmajor, WRITE_WACT=wact is not None,
        FAST_ACT=fast_activation, GROUPS=triton.next_power_of_2(E + 1), BAND=band,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages,
        num_warps=tile.num_warps,
    )
