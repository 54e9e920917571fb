"""Triton kernels of the expert forward: gathered grouped GEMMs and the combine.

Both GEMMs run one persistent grid over output tiles. A tile is (m-tile, n-tile) where
the m-tiles are laid end to end over the experts' row ranges, read from the device-side
``expert_offsets`` by every program (``_tile_of``): no host ever sees the counts. The
rows past ``expert_offsets[E]`` (sentinels) form one more group whose tiles only write
zeros. Tiles are numbered with n fastest, so programs running side by side share their
gathered A rows and their expert's weights in L2.

- ``_up_kernel``: h = x[expert_token_indices] @ W_e (+ b): the token rows are gathered
  inside the A-operand load; no [L*K, d] copy exists.
- ``_down_kernel``: y = act(h) @ W_e (+ b): the activation is computed on the A tile as it
  is loaded (the activated [L*K, I] tensor is never written).
- ``_combine_kernel``: out[i] = sum over k = 0..K-1, in that order, of
  w[i, k] * y[token_index_map[i*K + k]] in fp32: deterministic, no atomics.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import triton_activations as acts
from .triton_activations import ACT_CODES, is_gated_code

#: Tests set this to fill every buffer with NaN before the kernels run, so that any
#: element a kernel forgets to write shows up.
POISON = False
#: Tuning scripts set these to try tile configs: {"up"|"down": (BM, BN, BK, warps, stages)}
#: and the number of persistent programs per SM.
CONFIG_OVERRIDE: dict = {}
PROGRAMS_PER_SM = 1
#: Width in columns of the slabs in which the two [L*K, d] scratch buffers are made and
#: consumed: the down GEMM's expert outputs (then the combine) and the input gradient's
#: rows (then their sum). 0: all d columns at once. A slab of S columns keeps the
#: scratch at [L*K, S], the same GEMM work in d/S launches. 512 on the H200: training-
#: forward peak 0.65x -> 0.59-0.61x of compiled grouped_mm on conf3, conf4 and
#: Mixtral-like, time within 3% (256: another 0.01x for 3% more time). Environment
#: variable ``MOEBLAZE_D_SLAB`` overrides it (0 turns slabs off).
D_SLAB = int(os.environ.get("MOEBLAZE_D_SLAB", "512")) or None


def column_slabs(d):
    """The [c0, c1) column ranges the [L*K, d] scratch is made in (``D_SLAB``)."""
    step = D_SLAB if D_SLAB and D_SLAB < d else max(d, 1)
    return [(c0, min(d, c0 + step)) for c0 in range(0, d, step)]


def weight_columns(w, c0, c1, out_dim):
    """The slice [c0, c1) of weight ``w``'s output dimension ``out_dim`` (1 or 2), a view."""
    return w[:, c0:c1] if out_dim == 1 else w[:, :, c0:c1]


def _empty(*shape, dtype, device):
    t = torch.empty(*shape, dtype=dtype, device=device)
    if POISON:
        t.fill_(float("nan"))
    return t


@triton.jit
def _group_bounds(offsets_ptr, E, LK, GROUPS: tl.constexpr):
    """Row range [lo, hi) of each group: the E experts, then group E holding the sentinels."""
    g = tl.arange(0, GROUPS)
    lo = tl.load(offsets_ptr + g, mask=g <= E, other=0)
    hi = tl.load(offsets_ptr + g + 1, mask=g < E, other=0)
    return g, lo, tl.where(g == E, LK, hi)


@triton.jit
def _num_tiles(offsets_ptr, E, LK, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    _, lo, hi = _group_bounds(offsets_ptr, E, LK, GROUPS)
    return tl.sum(tl.cdiv(hi - lo, BLOCK_M), axis=0) * tl.cdiv(N, BLOCK_N)


@triton.jit
def _tile_of(tile, offsets_ptr, E, LK, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """(group, first row, rows, row mask, columns, column mask) of an output tile."""
    g, lo, hi = _group_bounds(offsets_ptr, E, LK, GROUPS)
    m_tiles = tl.cdiv(hi - lo, BLOCK_M)
    tile_end = tl.cumsum(m_tiles, axis=0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    m = tile // n_tiles
    grp = tl.sum((tile_end <= m).to(tl.int32), axis=0)
    first_tile = tl.sum(tl.where(g == grp, tile_end - m_tiles, 0), axis=0)
    row0 = tl.sum(tl.where(g == grp, lo, 0), axis=0) + (m - first_tile) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = (tile % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    return grp, row0, rows, rows < tl.sum(tl.where(g == grp, hi, 0), axis=0), cols, cols < N


@triton.jit
def _weight_tile(w_src, e, k0, n0, stride_we, stride_wk, stride_wn, K, N, W_TMA: tl.constexpr,
                 W_KMAJOR: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Expert e's weight as the B operand: a [BLOCK_K, BLOCK_N] tile at (k0, n0).

    With W_TMA, ``w_src`` is a 3-D TMA descriptor of the [E, ., .] weight whose block is
    [1, BLOCK_N, BLOCK_K] when the reduction dimension is the contiguous one (W_KMAJOR),
    else [1, BLOCK_K, BLOCK_N]: the copy engine fills zeros past the expert's own edges.
    """
    # One return, every branch assigning: code after an early return inside a constexpr
    # `if` is still compiled, and the pointer arithmetic below fails on a descriptor.
    if W_TMA:
        if W_KMAJOR:
            tile = tl.trans(tl.reshape(w_src.load([e, n0, k0]), (BLOCK_N, BLOCK_K)))
        else:
            tile = tl.reshape(w_src.load([e, k0, n0]), (BLOCK_K, BLOCK_N))
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        cols = n0 + tl.arange(0, BLOCK_N)
        tile = tl.load(w_src + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                       mask=(ks < K)[:, None] & (cols < N)[None, :], other=0.0)
    return tile


@triton.jit
def _up_kernel(
    x_ptr, w_ptr, b_ptr, eti_ptr, offsets_ptr, h_ptr,
    LK, E, N, D,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_be, stride_hm,
    HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATHER: tl.constexpr = True,
    W_TMA: tl.constexpr = False, W_KMAJOR: tl.constexpr = False,
):
    total = _num_tiles(offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        e, row0, rows, rmask, cols, cmask = _tile_of(tile, offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if e < E:
            # A rows: gathered token rows (forward), or the rows themselves (input gradient).
            if GATHER:
                tok = tl.load(eti_ptr + rows, mask=rmask, other=0).to(tl.int64)
            else:
                tok = rows.to(tl.int64)
            for k0 in range(0, D, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                kmask = ks < D
                a = tl.load(x_ptr + tok[:, None] * stride_xm + ks[None, :] * stride_xk,
                            mask=rmask[:, None] & kmask[None, :], other=0.0)
                b = _weight_tile(w_ptr, e, k0, (tile % tl.cdiv(N, BLOCK_N)) * BLOCK_N, stride_we, stride_wk,
                                 stride_wn, D, N, W_TMA, W_KMAJOR, BLOCK_K, BLOCK_N)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if HAS_BIAS:
                acc += tl.load(b_ptr + e * stride_be + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :],
                 acc.to(h_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _load_act_operand(h_src, row0, rmask, stride_hm, k0, I, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
                      H_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The raw h tiles behind A columns [k0, k0 + BLOCK_K): (gate, up), or (h, h) when not gated.

    With H_TMA, ``h_src`` is a tensor descriptor of h: the expert's rows are contiguous, so
    whole tiles come through the copy engine, and the pipeliner can stage them although
    they feed the activation rather than the dot. Rows past the expert's range and columns
    past the gate half are read too; they only reach outputs that are masked or A columns
    that are zeroed before the dot.
    """
    ks = k0 + tl.arange(0, BLOCK_K)
    if H_TMA:
        if ACT < 3:
            if INTERLEAVED:
                g, u = tl.split(tl.reshape(h_src.load([row0, 2 * k0]), (BLOCK_M, BLOCK_K, 2)))
            else:
                g = h_src.load([row0, k0])
                u = h_src.load([row0, I + k0])
        else:
            g = h_src.load([row0, k0])
            u = g
    else:
        h_rows = h_src + (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None] * stride_hm
        amask = rmask[:, None] & (ks < I)[None, :]
        if ACT < 3:
            if INTERLEAVED:
                ks2 = k0 * 2 + tl.arange(0, 2 * BLOCK_K)
                gu = tl.load(h_rows + ks2[None, :], mask=rmask[:, None] & (ks2 < 2 * I)[None, :], other=0.0)
                g, u = tl.split(tl.reshape(gu, (BLOCK_M, BLOCK_K, 2)))
            else:
                g = tl.load(h_rows + ks[None, :], mask=amask, other=0.0)
                u = tl.load(h_rows + I + ks[None, :], mask=amask, other=0.0)
        else:
            g = tl.load(h_rows + ks[None, :], mask=amask, other=0.0)
            u = g
    return g, u


@triton.jit
def _activate(g, u, alpha, limit, ACT: tl.constexpr, FAST: tl.constexpr):
    if ACT < 3:
        return acts.gated(g.to(tl.float32), u.to(tl.float32), ACT, alpha, limit, FAST)
    return acts.plain(g.to(tl.float32), ACT, FAST)


@triton.jit
def _down_kernel(
    h_src, w_ptr, b_ptr, offsets_ptr, y_ptr,
    LK, E, N, I, alpha, limit,
    stride_hm, stride_we, stride_wk, stride_wn, stride_be, stride_ym,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, H_TMA: tl.constexpr,
    FAST_ACT: tl.constexpr, GROUPS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    total = _num_tiles(offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        e, row0, rows, rmask, cols, cmask = _tile_of(tile, offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if e < E:
            n0 = (tile % tl.cdiv(N, BLOCK_N)) * BLOCK_N
            for k0 in range(0, I, BLOCK_K):
                # Prologue: the A tile is act(h), computed in fp32 in registers as it is
                # loaded; the activated [L*K, I] tensor is never written.
                g, u = _load_act_operand(h_src, row0, rmask, stride_hm, k0, I, ACT, INTERLEAVED, H_TMA,
                                         BLOCK_M, BLOCK_K)
                ks = k0 + tl.arange(0, BLOCK_K)
                # Plain loads, never TMA (W_TMA has no "down": docs/perf-notes.md).
                b = _weight_tile(w_ptr, e, k0, n0, stride_we, stride_wk, stride_wn, I, N, False, False,
                                 BLOCK_K, BLOCK_N)
                a = tl.where((ks < I)[None, :], _activate(g, u, alpha, limit, ACT, FAST_ACT), 0.0)
                acc = tl.dot(a.to(b.dtype), b, acc, input_precision=PRECISION)
            if HAS_BIAS:
                acc += tl.load(b_ptr + e * stride_be + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _combine_kernel(
    y_ptr, tim_ptr, tw_ptr, offsets_ptr, out_ptr, L, D, E,
    stride_ym, stride_tw0, stride_tw1, stride_om,
    K: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr = True,
):
    toks = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = toks < L
    cmask = cols < D
    real_rows = tl.load(offsets_ptr + E)
    acc = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):  # fixed order: bitwise deterministic
        pos = tl.load(tim_ptr + toks.to(tl.int64) * K + k, mask=tmask, other=0)
        keep = tmask & (pos < real_rows)  # sentinel rows add nothing
        if WEIGHTED:
            w = tl.load(tw_ptr + toks * stride_tw0 + k * stride_tw1, mask=keep, other=0.0).to(tl.float32)
        else:  # the input gradient: a plain sum of the K rows
            w = tl.where(keep, 1.0, 0.0)
        y = tl.load(y_ptr + pos.to(tl.int64)[:, None] * stride_ym + cols[None, :],
                    mask=keep[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += w[:, None] * y
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


# --------------------------------------------------------------------------- launchers


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 is fp32: no silent tf32


def _num_programs(device, max_tiles, per_sm=None):
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:  # the interpreter
        sms = 4
    return max(1, min((per_sm or PROGRAMS_PER_SM) * sms, max_tiles))


def _gemm_config(dtype, kind):
    """Tile shapes (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the "up" or "down" GEMM.

    The 16-bit ones are the best of scripts/tune_forward.py on the H200 (olmoe, mixtral
    shapes; docs/perf-notes.md); both kinds measured best at the same tile.
    """
    if dtype == torch.float32:
        return 64, 64, 32, 4, 3
    # Down: BK=64 with 3 stages against BK=32 with 4: OLMoE-like 4.60 -> 3.50 ms,
    # Mixtral-like 13.28 -> 10.40 ms (docs/bench/tune-round7-down-bk64.txt).
    return (128, 256, 64, 8, 3)


def _tiles(device, dtype, kind, configs=None):
    """The tile config of GEMM ``kind``: a tuning override, else ``configs`` (this module's
    ``_gemm_config`` by default; the backward module passes its own)."""
    if device.type != "cuda":  # the interpreter: small tiles keep CPU tests quick
        return 16, 16, 16, 4, 1
    return CONFIG_OVERRIDE.get(kind) or (configs or _gemm_config)(dtype, kind)


def _launch_gemm(kernel, device, dtype, tiles, n_cols, **kwargs):
    """Launches a GEMM on the persistent (m-tile, n-tile) schedule of ``_tile_of`` over
    ``n_cols`` output columns; ``tiles`` is (BM, BN, BK, warps, stages[, programs per SM])."""
    LK, E = kwargs["LK"], kwargs["E"]
    BM, BN, BK, warps, stages, *per_sm = tiles
    max_tiles = (triton.cdiv(LK, BM) + E + 1) * triton.cdiv(n_cols, BN)
    grid = (_num_programs(device, max_tiles, *per_sm),)
    kernel[grid](**kwargs, GROUPS=triton.next_power_of_2(E + 1), PRECISION=_precision(dtype),
                 BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps, num_stages=stages)


#: Whether the down kernel reads h through a TMA tensor descriptor when it can (tuning switch).
H_TMA = True
#: Whether 16-bit CUDA runs use the approximate-tanh sigmoid (tuning switch).
FAST_ACT = True


def _fast_act(t):
    """Whether to use the approximate-tanh sigmoid for tensors like ``t``: CUDA, 16-bit."""
    return FAST_ACT and t.is_cuda and t.dtype != torch.float32


def _h_source(h, act, interleaved, I, BM, BK):
    """h as a GEMM reads its [BM, BK] activation tiles (activation code ``act``): a TMA
    tensor descriptor where TMA allows it, else the tensor; and which of the two it is."""
    # TMA needs 16-byte aligned rows and tile starts (the up half starts at column I), and a
    # box at most 256 elements wide (the interleaved layout reads 2*BK columns at once).
    width = 2 * BK if is_gated_code(act) and interleaved else BK
    aligned = (h.stride(1) == 1 and (h.stride(0) * h.element_size()) % 16 == 0 and h.data_ptr() % 16 == 0
               and (I * h.element_size()) % 16 == 0)
    if not (H_TMA and aligned and width <= 256):
        return h, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(h, [BM, width]), True


#: Per GEMM kind, whether it reads weight tiles through TMA descriptors where it can
#: (tuning switch). From the H200 sweep (docs/perf-notes.md): faster for dH (OLMoE-like
#: 3.22 -> 3.08 ms, Mixtral-like 10.36 -> 9.41), dX and the up GEMM on large experts.
#: The down GEMM has no such option: it measured slower (its activation prologue is its
#: bottleneck), and at its 128x256x64 tile the H200 gave wrong outputs with it
#: (docs/bench/probe-down-wtma-h200.txt; other tiles were right, so the compiler, not the indexing).
W_TMA = {"up": True, "dh": True, "dx": True}


def _weight_source(w, swk, BK, BN, kind):
    """The weight as GEMM ``kind`` reads it: ``(source, W_TMA, W_KMAJOR)``. ``swk`` is the
    stride of the reduction dimension; the other one of the last two is the output dimension."""
    kmajor = swk == 1
    # TMA: the last dimension contiguous, the other strides and the start 16-byte aligned
    # (column slabs of a weight are such views).
    aligned = (w.stride(2) == 1 and all(s * w.element_size() % 16 == 0 for s in w.stride()[:2])
               and w.data_ptr() % 16 == 0 and max(BK, BN) <= 256)
    if not (W_TMA.get(kind) and aligned):
        return w, False, kmajor
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w, [1, BN, BK] if kmajor else [1, BK, BN]), True, kmajor


def _weight_strides(w, transposed):
    """(expert, reduction, output) strides of a weight, for either layout."""
    return (w.stride(0), w.stride(1), w.stride(2)) if transposed else (w.stride(0), w.stride(2), w.stride(1))


def expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up, transposed):
    LK = expert_token_indices.shape[0]
    E = w_gate_up.shape[0]
    N = w_gate_up.shape[2] if transposed else w_gate_up.shape[1]
    d = x.shape[1]
    h = _empty(LK, N, dtype=x.dtype, device=x.device)
    if LK == 0 or N == 0:
        return h
    swe, swk, swn = _weight_strides(w_gate_up, transposed)
    bias = b_gate_up if b_gate_up is not None else w_gate_up
    tiles = _tiles(x.device, x.dtype, "up")
    w_src, w_tma, w_kmajor = _weight_source(w_gate_up, swk, tiles[2], tiles[1], "up")
    _launch_gemm(
        _up_kernel, x.device, x.dtype, tiles, N, W_TMA=w_tma, W_KMAJOR=w_kmajor,
        x_ptr=x, w_ptr=w_src, b_ptr=bias, eti_ptr=expert_token_indices, offsets_ptr=expert_offsets, h_ptr=h,
        LK=LK, E=E, N=N, D=d, stride_xm=x.stride(0), stride_xk=x.stride(1),
        stride_we=swe, stride_wk=swk, stride_wn=swn,
        stride_be=b_gate_up.stride(0) if b_gate_up is not None else 0, stride_hm=h.stride(0),
        HAS_BIAS=b_gate_up is not None,
    )
    return h


def expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
                activation, transposed, interleaved, alpha, limit):
    L, K = topk_weights.shape
    LK = h.shape[0]
    E = w_down.shape[0]
    d = w_down.shape[2] if transposed else w_down.shape[1]
    I = w_down.shape[1] if transposed else w_down.shape[2]
    if h.stride(1) != 1:
        h = h.contiguous()
    out = _empty(L, d, dtype=h.dtype, device=h.device)
    tiles = _tiles(h.device, h.dtype, "down")
    h_src, h_tma = _h_source(h, ACT_CODES[activation], interleaved, I, tiles[0], tiles[2])

    def expert_outputs(y, c0, c1):  # columns [c0, c1) of every row's output; sentinel rows zero
        w = weight_columns(w_down, c0, c1, 2 if transposed else 1)
        b = b_down[:, c0:c1] if b_down is not None else None
        swe, swk, swn = _weight_strides(w, transposed)
        _launch_gemm(
            _down_kernel, h.device, h.dtype, tiles, c1 - c0,
            h_src=h_src, w_ptr=w, b_ptr=b if b is not None else w, offsets_ptr=expert_offsets,
            y_ptr=y, LK=LK, E=E, N=c1 - c0, I=I, alpha=float(alpha), limit=float(limit),
            stride_hm=h.stride(0), stride_we=swe, stride_wk=swk, stride_wn=swn,
            stride_be=b.stride(0) if b is not None else 0, stride_ym=y.stride(0),
            ACT=ACT_CODES[activation], INTERLEAVED=interleaved, HAS_BIAS=b is not None, H_TMA=h_tma,
            # Approximate tanh for the sigmoid where the output is 16-bit (its error, 2^-11,
            # is below their rounding); fp32 keeps the exact form.
            FAST_ACT=_fast_act(h),
        )

    return combine_in_slabs(expert_outputs, LK, h.dtype, token_index_map, topk_weights, expert_offsets, out, E)


def combine_in_slabs(make_rows, LK, dtype, token_index_map, topk_weights, expert_offsets, out, E):
    """``combine`` of [L*K, d] rows made one column slab at a time (``D_SLAB``):
    ``make_rows(rows, c0, c1)`` writes columns [c0, c1) of every row into the
    [L*K, c1 - c0] view ``rows`` of one scratch buffer, then they are summed into
    ``out[:, c0:c1]``."""
    slabs = column_slabs(out.shape[1])
    scratch = _empty(LK, slabs[0][1] - slabs[0][0] if slabs else 0, dtype=dtype, device=out.device)
    for c0, c1 in slabs:
        rows = scratch[:, :c1 - c0]
        if LK > 0:
            make_rows(rows, c0, c1)
        combine(rows, token_index_map, topk_weights, expert_offsets, out[:, c0:c1], E)
    return out


def combine(rows, token_index_map, topk_weights, expert_offsets, out, E):
    """out[i] = sum_k w[i, k] * rows[token_index_map[i*K + k]]; unit weights when topk_weights is None."""
    L, d = out.shape
    if L == 0 or d == 0:
        return out
    K = token_index_map.shape[0] // L
    BLOCK_L, BLOCK_D = (32, 128) if rows.is_cuda else (16, 16)
    grid = (triton.cdiv(L, BLOCK_L), triton.cdiv(d, BLOCK_D))
    tw = topk_weights if topk_weights is not None else rows
    _combine_kernel[grid](
        rows, token_index_map, tw, expert_offsets, out, L, d, E,
        rows.stride(0), tw.stride(0) if topk_weights is not None else 0,
        tw.stride(1) if topk_weights is not None else 0, out.stride(0),
        K=K, BLOCK_L=BLOCK_L, BLOCK_D=BLOCK_D, WEIGHTED=topk_weights is not None,
    )
    return out
