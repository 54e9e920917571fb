"""The Triton templates of the expert ops: each a thin persistent loop over the eager
kernels' own ``@triton.jit`` tile functions, ending in Inductor's ``store_output``.

- ``row_gemm``: out[r] = A[a_row_ids[r] or r] @ B_e (+ bias_e), one tile at a time from
  ``triton_backend.experts.gathered_gemm_tile``: the up projection (A rows gathered from x) and
  the down projection (A = act(h), in expert order), and the dX rows of backward (A =
  dH, B the up projection's weight read the other way round).
- ``activated_row_gemm``: a[r] = act(x[a_row_ids[r]] @ B_e + bias_e), the up projection with
  its activation in the epilogue (h never stored), from ``triton_backend.experts.activated_gemm_tile``.
- ``activation``: a = act(h), from ``triton_backend.grouped_gemm.load_h_pair`` and ``activate``.
- ``combine``: out[i] = sum_k w[i, k] * rows[token_index_map[i*K + k]] in the order
  k = 0..K-1, from ``triton_backend.combine.combine_tile``; unit weights without ``WEIGHTED``
  (the input gradient's sum of each token's dX rows).

``store_output`` is where Inductor fuses the pointwise consumers of the output (a residual
add, a scale, a cast) into the kernel's epilogue. Every template runs ``NUM_PROGRAMS``
programs that stride over the tiles, so the grid does not depend on the (possibly
symbolic) token count.
"""

from __future__ import annotations

from .compat import SymbolicGridFn, TritonTemplate


@SymbolicGridFn
def persistent_grid(*args):
    """``NUM_PROGRAMS`` programs, whatever the sizes."""
    meta = args[-1]
    return (meta["NUM_PROGRAMS"], 1, 1)


# The templates import the helpers by module path: the kernel source Inductor writes and
# compiles (possibly in a worker process) resolves them there.
_ROW_GEMM = r"""
from moeblaze_ops.kernels.triton_backend import grouped_gemm as gg
from moeblaze_ops.kernels.triton_backend.experts import gathered_gemm_tile

{%- set inputs = ["a_ptr", "b_ptr"] + (["a_row_ids_ptr"] if GATHER_A else []) + ["offsets_ptr"]
                 + (["bias_ptr"] if HAS_BIAS else []) %}
{{def_kernel(*inputs)}}
    LK = {{size(None, 0)}}
    N = {{size(None, 1)}}
    E = {{size("b_ptr", 0)}}
    REDUCTION = {{size("a_ptr", 1)}}
{%- if B_TMA %}
    # A device-side descriptor of the weight as it lies: the copy engine zero-fills past
    # each expert's own edges.
    b_src = tl.make_tensor_descriptor(
        b_ptr, shape=[{{size("b_ptr", 0)}}, {{size("b_ptr", 1)}}, {{size("b_ptr", 2)}}],
        strides=[{{stride("b_ptr", 0)}}, {{stride("b_ptr", 1)}}, 1],
        block_shape={{"[1, BLOCK_N, BLOCK_K]" if B_KMAJOR else "[1, BLOCK_K, BLOCK_N]"}})
{%- else %}
    b_src = b_ptr
{%- endif %}
    total = gg.num_row_tiles(offsets_ptr, E, LK, N, BLOCK_M, BLOCK_N, GROUPS)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        rows, rmask, cols, cmask, acc = gathered_gemm_tile(
            tile, a_ptr, b_src, {{"bias_ptr" if HAS_BIAS else "None"}}, {{"a_row_ids_ptr" if GATHER_A else "None"}},
            offsets_ptr, LK, E, N, REDUCTION, {{stride("a_ptr", 0)}}, {{stride("a_ptr", 1)}},
            {{stride("b_ptr", 0)}}, {{stride("b_ptr", 1 if TRANSPOSED else 2)}}, {{stride("b_ptr", 2 if TRANSPOSED else 1)}},
            {{stride("bias_ptr", 0) if HAS_BIAS else 0}}, GATHER_A, HAS_BIAS, B_TMA, B_KMAJOR, GROUPS, BAND,
            PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        idx_m = rows.to(INDEX_DTYPE)[:, None]
        idx_n = cols[None, :]
        mask = rmask[:, None] & cmask[None, :]
        {{store_output(("idx_m", "idx_n"), "acc", "mask", indent_width=8, val_shape=("BLOCK_M", "BLOCK_N"))}}
"""

_ACTIVATED_ROW_GEMM = r"""
from moeblaze_ops.kernels.triton_backend import grouped_gemm as gg
from moeblaze_ops.kernels.triton_backend.experts import activated_gemm_tile

{%- set inputs = ["a_ptr", "b_ptr", "a_row_ids_ptr", "offsets_ptr"] + (["bias_ptr"] if HAS_BIAS else []) %}
{{def_kernel(*inputs)}}
    LK = {{size(None, 0)}}
    I = {{size(None, 1)}}
    E = {{size("b_ptr", 0)}}
    REDUCTION = {{size("a_ptr", 1)}}
    total = gg.num_row_tiles(offsets_ptr, E, LK, I, BLOCK_M, BLOCK_N, GROUPS)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        rows, rmask, cols, cmask, acc = activated_gemm_tile(
            tile, a_ptr, b_ptr, {{"bias_ptr" if HAS_BIAS else "None"}}, a_row_ids_ptr, offsets_ptr, LK, E, I, REDUCTION,
            {{stride("a_ptr", 0)}}, {{stride("a_ptr", 1)}}, {{stride("b_ptr", 0)}},
            {{stride("b_ptr", 1 if TRANSPOSED else 2)}}, {{stride("b_ptr", 2 if TRANSPOSED else 1)}},
            {{stride("bias_ptr", 0) if HAS_BIAS else 0}}, ALPHA, LIMIT, ACT, INTERLEAVED, FAST_ACT, True, HAS_BIAS,
            GROUPS, BAND, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        idx_m = rows.to(INDEX_DTYPE)[:, None]
        idx_n = cols[None, :]
        mask = rmask[:, None] & cmask[None, :]
        {{store_output(("idx_m", "idx_n"), "acc", "mask", indent_width=8, val_shape=("BLOCK_M", "BLOCK_N"))}}
"""

_ACTIVATION = r"""
from moeblaze_ops.kernels.triton_backend import grouped_gemm as gg
from moeblaze_ops.kernels.triton_backend.activations import activate

{{def_kernel("h_ptr")}}
    LK = {{size(None, 0)}}
    I = {{size(None, 1)}}
    k_tiles = tl.cdiv(I, BLOCK_K)
    for tile in range(tl.program_id(0), tl.cdiv(LK, BLOCK_M) * k_tiles, tl.num_programs(0)):
        row0 = (tile // k_tiles) * BLOCK_M
        k0 = (tile % k_tiles) * BLOCK_K
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = k0 + tl.arange(0, BLOCK_K)
        rmask = rows < LK
        g, u = gg.load_h_pair(h_ptr, row0, rmask, {{stride("h_ptr", 0)}}, k0, I, ACT, INTERLEAVED, BLOCK_M,
                              BLOCK_K)
        acc = activate(g, u, ALPHA, LIMIT, ACT, FAST_ACT)
        idx_m = rows.to(INDEX_DTYPE)[:, None]
        idx_n = cols[None, :]
        mask = rmask[:, None] & (cols < I)[None, :]
        {{store_output(("idx_m", "idx_n"), "acc", "mask", indent_width=8, val_shape=("BLOCK_M", "BLOCK_K"))}}
"""

_COMBINE = r"""
from moeblaze_ops.kernels.triton_backend.combine import combine_tile

{%- set inputs = ["rows_ptr", "tim_ptr"] + (["weights_ptr"] if WEIGHTED else []) + ["offsets_ptr"] %}
{{def_kernel(*inputs)}}
    L = {{size(None, 0)}}
    D = {{size(None, 1)}}
    E = {{size("offsets_ptr", 0)}} - 1
    real_rows = tl.load(offsets_ptr + E)
    d_tiles = tl.cdiv(D, BLOCK_D)
    for tile in range(tl.program_id(0), tl.cdiv(L, BLOCK_L) * d_tiles, tl.num_programs(0)):
        toks = (tile // d_tiles) * BLOCK_L + tl.arange(0, BLOCK_L)
        cols = (tile % d_tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
        tmask = toks < L
        cmask = cols < D
        acc = combine_tile(rows_ptr, tim_ptr, {{"weights_ptr" if WEIGHTED else "None"}}, real_rows, toks, tmask, cols,
                           cmask, {{stride("rows_ptr", 0)}}, {{stride("weights_ptr", 0) if WEIGHTED else 0}},
                           {{stride("weights_ptr", 1) if WEIGHTED else 0}}, K, WEIGHTED)
        idx_m = toks.to(INDEX_DTYPE)[:, None]
        idx_n = cols[None, :]
        mask = tmask[:, None] & cmask[None, :]
        {{store_output(("idx_m", "idx_n"), "acc", "mask", indent_width=8, val_shape=("BLOCK_L", "BLOCK_D"))}}
"""

row_gemm = TritonTemplate(name="moeblaze_row_gemm", grid=persistent_grid, source=_ROW_GEMM)
activated_row_gemm = TritonTemplate(name="moeblaze_activated_row_gemm", grid=persistent_grid,
                                    source=_ACTIVATED_ROW_GEMM)
activation = TritonTemplate(name="moeblaze_activation", grid=persistent_grid, source=_ACTIVATION)
combine = TritonTemplate(name="moeblaze_combine", grid=persistent_grid, source=_COMBINE)
