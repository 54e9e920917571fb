"""The lowerings of the expert ops to the templates.

- ``expert_up``: one ``row_gemm`` (A rows gathered from x through the dispatch's
  ``expert_token_indices``) writing h. Where the op runs instead (below) and its h feeds
  one ``expert_down`` whose activation the up GEMM's epilogue can apply, under
  ``config.activation_beside_h`` (the size hints), it writes act(h) beside h, as eager
  training does: the internal op ``_expert_up_beside``, and the ``expert_down`` is
  lowered to the down projection of act(h) (``_expert_down_activated`` or the
  templates), with no activation pass.
- ``expert_layer`` (the layer without gradients): the op itself where its up GEMM runs
  on Gluon (its epilogue writes act(h), no h) and on FP8 weights; elsewhere, where
  ``config.activates_in_up_epilogue`` says so (small GEMMs: decode), the up GEMM with the
  activation in its epilogue (``activated_row_gemm``, no h) and the down projection of
  act(h); else ``expert_up``'s and ``expert_down``'s templates.
- ``expert_down``: ``activation`` writes a = act(h) once; then, one column slab of the
  output at a time (``settings.column_slab``, as the eager kernels make their [L*K, d]
  scratch), a ``row_gemm`` on a writes the slab of every routed row and ``combine`` sums
  each token's K rows into it. With one slab the combine's ``store_output`` writes the
  layer output, and Inductor fuses its pointwise consumers into that epilogue; with more,
  Inductor's ``cat`` joins the slabs (and takes the pointwise consumers).
- ``expert_up_backward``: grad_x as the down projection's pattern on dH (``row_gemm``
  per slab, then an unweighted ``combine``); the weight gradients stay the op's kernels.
- ``expert_down_backward``: the op's kernels, in place over h where h is donated to it.
- ``dispatch``: the op's kernels, as an extern call.

Each lowering falls back to the op itself (an extern call, as for an op without a
lowering, with the arguments the graph gave it: ``moe_experts`` and the formulas pass
``validate=False``, their arguments being checked already) where the
templates do not apply: tensors not on CUDA,
float64, ``settings.backend == "torch"``, and index arrays
that do not come straight from ``moeblaze::dispatch`` in the same graph (the op checks
such arrays' values; the templates do not); and where the op would run the GEMM on its
Gluon kernel (Hopper, at least ``config.SMALL_GEMM_FLOP``), which is faster than a
``tl`` template.

The tile is the eager kernels' (``config.pick_tile``) unless ``mode="max-autotune"``
asks Inductor to benchmark the table's other tiles too, on index arrays made valid by
``input_gen_fns``. The settings in force when the graph compiles are the ones it keeps.
"""

from __future__ import annotations

import operator
import weakref

import torch
import triton
from torch._inductor import config as inductor_config
from torch._inductor.virtualized import V

from moeblaze_ops import settings
from moeblaze_ops.activations import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT, activation_code, is_gated
from moeblaze_ops.kernels import config
from moeblaze_ops.kernels.triton_backend import grouped_gemm as gg
from moeblaze_ops.kernels.triton_backend.activations import is_gated_code
from moeblaze_ops.kernels.triton_backend.combine import COMBINE_TILE, column_slabs, widest_slab
from moeblaze_ops.kernels.triton_backend.experts import ACTIVATION_TILE, activated_tile

from . import compat, templates

_ops = torch.ops.moeblaze


# --------------------------------------------------------------------------- when the templates apply

# FX argument positions of the index arrays (expert_token_indices, expert_offsets,
# token_index_map) in each forward op.
_UP_INDEX_ARRAYS = _DOWN_INDEX_ARRAYS = (2, 3, 4)
_LAYER_INDEX_ARRAYS = (3, 4, 5)


def _from_dispatch(arg) -> bool:
    """Whether the FX value ``arg`` is one of ``moeblaze::dispatch``'s outputs."""
    return (isinstance(arg, torch.fx.Node) and arg.target is operator.getitem
            and getattr(arg.args[0], "target", None) is _ops.dispatch.default)


def _templates_apply(node, index_positions) -> bool:
    """Whether the op being lowered runs as templates: a CUDA tensor of a dtype the Triton
    kernels take, the Triton backend in force, and its index arrays (at FX argument
    positions ``index_positions``; none for a backward op) made by a dispatch in this graph."""
    device, dtype = node.get_device(), node.get_dtype()
    if device is None or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if settings.current().backend == "torch":
        return False
    return _index_arrays_from_dispatch(index_positions)


def _index_arrays_from_dispatch(index_positions) -> bool:
    """Whether FX arguments ``index_positions`` of the node being lowered are all outputs
    of a ``moeblaze::dispatch`` in this graph."""
    args = V.graph.current_node.args
    return all(_from_dispatch(args[i] if i < len(args) else None) for i in index_positions)


def _widest_slab(kind, rows, reduction, weight, gated=False, backward_follows=True) -> int:
    """``triton_backend.combine.widest_slab`` of GEMM ``kind`` over ``rows`` routed rows
    ``reduction`` deep with the weight stack ``weight`` (``gated``: the down projection
    of a gated activation; ``backward_follows``: in training), by the size hints."""
    numel = 1
    for size in weight.get_size():
        numel *= compat.hint(size)
    return widest_slab(kind, compat.hint(rows), compat.hint(reduction), numel, gated, backward_follows)


def _op_runs_gluon(kind, a, rows, out_cols, reduction, weight=None, gated=False, backward_follows=True) -> bool:
    """Whether the op's own kernels would run GEMM ``kind`` (A = ``a`` over ``rows`` routed
    rows, ``out_cols`` output columns, ``reduction`` deep) on its Gluon kernel: the
    decision of ``triton_backend.grouped_gemm.gluon_module`` on each launch's operations (a column slab
    where down and dX make their rows in slabs, ``weight`` their weight stack; by the size
    hints), for a 16-bit ``a`` on a
    Hopper GPU, with column counts the Gluon kernel takes (``triton_backend.gluon.row_gemm.applies``:
    multiples of 16; its stride and alignment rules hold for the contiguous operands the
    graph makes). Those kernels are faster than the ``tl`` templates, so the graph calls
    the op there; elsewhere the op's ``tl`` kernel would run, and the template, as fast,
    lets consumers fuse. ``gated``, ``backward_follows``: as ``_widest_slab``'s."""
    device = a.get_device()
    if a.get_dtype() not in (torch.float16, torch.bfloat16) or device is None or device.type != "cuda":
        return False
    out_cols, reduction = compat.hint(out_cols), compat.hint(reduction)
    if kind != "up":
        slabs = column_slabs(out_cols, _widest_slab(kind, rows, reduction, weight, gated, backward_follows))
        out_cols = slabs[0][1] - slabs[0][0] if slabs else 0
    if out_cols % 16 or reduction % 16:
        return False
    if gg.gluon_module(kind, 2 * compat.hint(rows) * out_cols * reduction) is None:
        return False
    from moeblaze_ops.kernels.triton_backend.gluon.common import is_hopper  # importable: gluon_module found Gluon

    return is_hopper(device.index if device.index is not None else torch.cuda.current_device())


# --------------------------------------------------------------------------- configs


def _row_gemm_tiles(kind, dtype, device, rows, experts):
    """The eager kernels' tile (for the size hints); under max-autotune the table's other
    tiles that fit too."""
    first = config.pick_tile(kind, dtype, device, rows, experts)
    if not (inductor_config.max_autotune or inductor_config.max_autotune_gemm):
        return [first]
    others = config.candidate_tiles(("up", "down", "dx"), dtype, device)
    return [first] + [t for t in others if t != first]


def _tma_ready(w, tile) -> bool:
    """``triton_backend.grouped_gemm.weight_tma_fits`` for a weight node (sizes that are symbols: no)."""
    size = w.get_dtype().itemsize
    offset = _as_int(w.get_layout().offset)
    return gg.weight_tma_fits([_as_int(s) for s in w.get_stride()], size, None if offset is None else offset * size,
                              tile)


def _as_int(expr):
    try:
        return int(expr)
    except TypeError:
        return None


# --------------------------------------------------------------------------- valid inputs for autotuning


def _even_offsets(num_rows):
    """Expert offsets splitting ``num_rows`` rows evenly (benchmark inputs)."""
    def make(node):
        groups = compat.hint(node.get_size()[0])
        return torch.linspace(0, compat.hint(num_rows), groups).round().to(node.get_dtype()).to(node.get_device())
    return make


def _random_ids(high):
    """Random row ids in [0, high) (benchmark inputs)."""
    def make(node):
        return torch.randint(0, max(compat.hint(high), 1), [compat.hint(node.get_size()[0])], dtype=node.get_dtype(),
                             device=node.get_device())
    return make


# --------------------------------------------------------------------------- the template calls


def _row_gemm_operands(a, b, a_row_ids, offsets, bias, out_rows):
    """``(input nodes, input_gen_fns)`` of a row GEMM template: A, B, the row ids where A is
    gathered, the offsets, the bias where there is one; autotuning's stand-ins make the
    offsets and row ids valid."""
    inputs = [compat.realized(a), compat.realized(b)]
    gens = {}
    if a_row_ids is not None:
        gens[len(inputs)] = _random_ids(a.get_size()[0])
        inputs.append(compat.contiguous(a_row_ids))
    gens[len(inputs)] = _even_offsets(out_rows)
    inputs.append(compat.contiguous(offsets))
    if bias is not None:
        inputs.append(compat.realized(bias))
    return inputs, gens


def _row_schedule(tile, dtype, device, experts) -> dict:
    """The launch parameters every row GEMM template takes from its tile: the persistent
    grid over the ``row_tile`` schedule of ``experts`` experts (columns: ``BLOCK_N``, the
    template's own)."""
    return dict(num_stages=tile.num_stages, num_warps=tile.num_warps, GROUPS=triton.next_power_of_2(experts + 1),
                BAND=config.ROW_BAND, PRECISION=repr(gg.precision(dtype)),
                NUM_PROGRAMS=gg.num_programs(device, None, tile.programs_per_sm), BLOCK_M=tile.block_m,
                BLOCK_K=tile.block_k)


def row_gemm(kind, a, b, a_row_ids, offsets, bias, transposed, out_rows):
    """out[r] = A[a_row_ids[r] or r] @ B_e (+ bias_e) for ``out_rows`` routed rows, B an
    expert weight stack in ``transposed`` layout: the chosen template node."""
    E = b.get_size()[0]
    n_out = b.get_size()[2 if transposed else 1]
    dtype, device = a.get_dtype(), a.get_device()
    inputs, gens = _row_gemm_operands(a, b, a_row_ids, offsets, bias, out_rows)
    b = inputs[1]  # realized: its layout is the one the kernel reads
    layout = compat.fixed_layout(device, dtype, [out_rows, n_out])
    kmajor = b.get_stride()[1 if transposed else 2] == 1
    rows, experts = compat.hint(out_rows), compat.static_int(E)
    # The eager kernel's rule on the weight's TMA reads, by the size hints: not for small GEMMs.
    reduction = compat.hint(b.get_size()[1 if transposed else 2])
    weight_tma = config.reads_weight_by_tma(kind, 2 * rows * compat.hint(n_out) * reduction)
    choices = []
    for tile in _row_gemm_tiles(kind, dtype, device, rows, experts):
        templates.row_gemm.maybe_append_choice(
            choices, input_nodes=inputs, layout=layout, GATHER_A=a_row_ids is not None, HAS_BIAS=bias is not None,
            TRANSPOSED=transposed, B_TMA=weight_tma and _tma_ready(b, tile), B_KMAJOR=kmajor,
            BLOCK_N=tile.block_n, **_row_schedule(tile, dtype, device, experts))
    return compat.select_algorithm(f"moeblaze_{kind}", choices, inputs, layout, input_gen_fns=gens)


def activated_row_gemm(x, w, a_row_ids, offsets, bias, transposed, out_rows, act, interleaved, alpha, limit):
    """a[r] = act(x[a_row_ids[r]] @ W_e + bias_e) for ``out_rows`` routed rows: the up
    projection with its activation in the epilogue, the chosen template node ([L*K, I] for
    a gated ``act``, an ``ActivationCode``)."""
    E = w.get_size()[0]
    n_out = w.get_size()[2 if transposed else 1]
    columns = n_out // 2 if is_gated_code(act) else n_out
    dtype, device = x.get_dtype(), x.get_device()
    inputs, gens = _row_gemm_operands(x, w, a_row_ids, offsets, bias, out_rows)
    layout = compat.fixed_layout(device, dtype, [out_rows, columns])
    rows, experts = compat.hint(out_rows), compat.static_int(E)
    choices = []
    for tile in _row_gemm_tiles("up", dtype, device, rows, experts):
        templates.activated_row_gemm.maybe_append_choice(
            choices, input_nodes=inputs, layout=layout, HAS_BIAS=bias is not None, TRANSPOSED=transposed,
            ACT=int(act), INTERLEAVED=interleaved, ALPHA=float(alpha), LIMIT=float(limit),
            FAST_ACT=dtype != torch.float32, BLOCK_N=activated_tile(tile, act).block_n,
            **_row_schedule(tile, dtype, device, experts))
    return compat.select_algorithm("moeblaze_up_activated", choices, inputs, layout, input_gen_fns=gens)


def activation_pass(h, I, act, interleaved, alpha, limit):
    """a = act(h) over every routed row: [L*K, I] in h's dtype."""
    h = compat.contiguous(h)
    dtype, device = h.get_dtype(), h.get_device()
    block_m, block_k = ACTIVATION_TILE
    layout = compat.fixed_layout(device, dtype, [h.get_size()[0], I])
    choices = []
    templates.activation.maybe_append_choice(
        choices, input_nodes=[h], layout=layout, num_stages=1, num_warps=4, ACT=int(act), INTERLEAVED=interleaved,
        ALPHA=float(alpha), LIMIT=float(limit),
        FAST_ACT=dtype != torch.float32,
        NUM_PROGRAMS=gg.num_programs(device, None, 4), BLOCK_M=block_m, BLOCK_K=block_k)
    return compat.select_algorithm("moeblaze_activation", choices, [h], layout)


def combine(rows, token_index_map, offsets, num_tokens, topk_weights=None):
    """out[i] = sum_k w[i, k] * rows[token_index_map[i*K + k]]: [num_tokens, cols]; unit
    weights without ``topk_weights`` (the input gradient's sum of each token's dX rows)."""
    L = num_tokens
    K = compat.static_int(topk_weights.get_size()[1] if topk_weights is not None
                          else token_index_map.get_size()[0] // L)
    inputs = [compat.realized(rows), compat.contiguous(token_index_map)]
    if topk_weights is not None:
        inputs.append(compat.realized(topk_weights))
    inputs.append(compat.contiguous(offsets))
    dtype, device = rows.get_dtype(), rows.get_device()
    layout = compat.fixed_layout(device, dtype, [L, rows.get_size()[1]])
    block_l, block_d = COMBINE_TILE
    choices = []
    templates.combine.maybe_append_choice(
        choices, input_nodes=inputs, layout=layout, num_stages=1, num_warps=4, K=K,
        WEIGHTED=topk_weights is not None, NUM_PROGRAMS=gg.num_programs(device, None, 4), BLOCK_L=block_l,
        BLOCK_D=block_d)
    return compat.select_algorithm("moeblaze_combine", choices, inputs, layout)


def combined_rows(kind, a, b, offsets, token_index_map, num_tokens, transposed, out_dim, topk_weights=None,
                  bias=None, gated=False, backward_follows=True):
    """``combine`` of the routed rows A_r @ B_e (+ bias_e), made one column slab at a time
    (``triton_backend.combine.column_slabs``, as the eager kernels make their [L*K, d] scratch): the
    forward's down projection (A = act(h); ``gated``: of a gated activation;
    ``backward_follows``: in training) and backward's dX (A = dH). ``out_dim`` is the
    dimension of B that holds the output columns."""
    slabs = []
    widest = _widest_slab(kind, a.get_size()[0], a.get_size()[1], b, gated, backward_follows)
    for c0, c1 in column_slabs(compat.static_int(b.get_size()[out_dim]), widest):
        w = compat.slice_view(b, out_dim, c0, c1)
        bias_slab = compat.slice_view(bias, 1, c0, c1) if bias is not None else None
        rows = row_gemm(kind, a, w, None, offsets, bias_slab, transposed, a.get_size()[0])
        slabs.append(combine(rows, token_index_map, offsets, num_tokens, topk_weights))
    return slabs[0] if len(slabs) == 1 else compat.concat(slabs, 1)


# --------------------------------------------------------------------------- the lowerings


@compat.register_lowering(_ops.dispatch.default, type_promotion_kind=None)
def dispatch(topk_ids, num_experts):
    """The op's kernels (with their device-side checks of the ids), as an extern call; its
    arguments' shapes were checked when the graph was traced."""
    return compat.fallback(_ops.dispatch.default, topk_ids, num_experts)


@compat.register_lowering(_ops.expert_up.default, type_promotion_kind=None)
def expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, b_gate_up=None,
              transposed=False, validate=True):
    """The template, or the op where its GEMM runs on Gluon or no template applies; the op
    then writes act(h) beside h for the down projection where ``_activation_beside_h``
    plans it."""
    rows, N = expert_token_indices.get_size()[0], w_gate_up.get_size()[2 if transposed else 1]
    if not _templates_apply(x, index_positions=_UP_INDEX_ARRAYS) \
            or _op_runs_gluon("up", x, rows, N, x.get_size()[1]):
        plan = _activation_beside_h(x, w_gate_up, rows, N, b_gate_up)
        if plan is not None:
            down, activation_args = plan
            h, a = compat.fallback(_ops._expert_up_beside.default, x, w_gate_up, expert_token_indices,
                                   expert_offsets, token_index_map, b_gate_up, transposed, *activation_args)
            down.meta[_ACTIVATED] = (weakref.ref(V.graph), a)
            return h
        return compat.fallback(_ops.expert_up.default, x, w_gate_up, expert_token_indices, expert_offsets,
                               token_index_map, b_gate_up, transposed, validate)
    return row_gemm("up", x, w_gate_up, expert_token_indices, expert_offsets, b_gate_up, transposed, rows)


#: The key of an ``expert_down`` FX node's ``meta`` under which the lowering of the
#: ``expert_up`` whose h it reads leaves ``(weak reference to the graph, act(h))``: act(h)
#: made beside h, for the down projection's lowering in that same graph.
_ACTIVATED = "moeblaze_activated"


def _activation_beside_h(x, w_gate_up, rows, N, b_gate_up):
    """``(down, (activation, interleaved, alpha, limit))`` where the ``expert_up`` being
    lowered (to the op) should write act(h) beside h for ``down``, the one
    ``expert_down`` FX node that reads its h, as eager training does
    (``config.activation_beside_h``, by the size hints): a gated activation with
    constant parameters, every index array from a dispatch in this graph (the internal ops
    check none). Else None: the down projection runs the activation pass."""
    up = V.graph.current_node
    downs = [user for user in up.users if user.target is _ops.expert_down.default]
    if len(downs) != 1 or not _index_arrays_from_dispatch(_UP_INDEX_ARRAYS):
        return None
    down = _named_args(downs[0])
    activation_args = tuple(down[name] for name in ("activation", "interleaved", "alpha", "limit"))
    if down["h"] is not up or not is_gated(down["activation"]) \
            or not all(isinstance(v, float) for v in activation_args[2:]) \
            or not all(_from_dispatch(down[name]) for name in ("expert_token_indices", "expert_offsets",
                                                                "token_index_map")):
        return None
    experts = compat.static_int(w_gate_up.get_size()[0])
    if not config.activation_beside_h(compat.hint(N) // 2, compat.hint(rows), experts,
                                      interleaved=down["interleaved"], up_bias=b_gate_up is not None):
        return None
    return downs[0], activation_args


def _named_args(node) -> dict:
    """FX node ``node``'s arguments by the names of its op's schema, defaults filled in."""
    arguments = node.target._schema.arguments
    named = {a.name: a.default_value for a in arguments if a.has_default_value()}
    named.update(zip((a.name for a in arguments), node.args))
    named.update(node.kwargs)
    return named


@compat.register_lowering(_ops.expert_down.default, type_promotion_kind=None)
def expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down=None,
                activation="swiglu", transposed=False, interleaved=False, alpha=CLAMPED_SWIGLU_ALPHA,
                limit=CLAMPED_SWIGLU_LIMIT, validate=True):
    args = (h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down, activation,
            transposed, interleaved, alpha, limit, validate)
    graph, a = V.graph.current_node.meta.pop(_ACTIVATED, (lambda: None, None))
    if graph() is V.graph:  # act(h) made beside h (``_activation_beside_h``): no activation pass
        return _down_projection_of_activated(a, w_down, expert_token_indices, expert_offsets, token_index_map,
                                             topk_weights, b_down, transposed)
    if not _templates_apply(h, index_positions=_DOWN_INDEX_ARRAYS):
        return compat.fallback(_ops.expert_down.default, *args)
    return _down_projection(*args)


def _down_projection(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
                     activation, transposed, interleaved, alpha, limit, validate, backward_follows=True):
    """``expert_down`` of h where the templates apply: the op where its GEMM runs on Gluon,
    else the activation pass, then the down GEMM and the combine in column slabs
    (``backward_follows``: in training, as ``_widest_slab``'s)."""
    out_dim = 2 if transposed else 1  # w_down is [E, d, I], or [E, I, d] when transposed
    gated = is_gated(activation)
    if _op_runs_gluon("down", h, h.get_size()[0], w_down.get_size()[out_dim], w_down.get_size()[3 - out_dim],
                      w_down, gated, backward_follows):
        return compat.fallback(_ops.expert_down.default, h, w_down, expert_token_indices, expert_offsets,
                               token_index_map, topk_weights, b_down, activation, transposed, interleaved, alpha,
                               limit, validate)
    a = activation_pass(h, w_down.get_size()[3 - out_dim], activation_code(activation), interleaved, alpha, limit)
    return combined_rows("down", a, w_down, expert_offsets, token_index_map, topk_weights.get_size()[0],
                         transposed, out_dim, topk_weights, b_down, gated, backward_follows)


def _down_projection_of_activated(a, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                                  b_down, transposed):
    """``expert_down`` of act(h) made beside h (a gated activation's): the op where no
    template applies, else ``_down_of_activated``."""
    if not _templates_apply(a, index_positions=_DOWN_INDEX_ARRAYS):
        return compat.fallback(_ops._expert_down_activated.default, a, w_down, expert_token_indices, expert_offsets,
                               token_index_map, topk_weights, b_down, transposed, True)
    return _down_of_activated(a, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
                              transposed, gated=True)


def _down_of_activated(a, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
                       transposed, gated, backward_follows=True):
    """The down GEMM and the combine of rows activated already (``gated``: by a gated
    activation; ``backward_follows``: in training): the op where its GEMM runs on Gluon,
    else the templates in column slabs."""
    out_dim = 2 if transposed else 1
    if _op_runs_gluon("down", a, a.get_size()[0], w_down.get_size()[out_dim], w_down.get_size()[3 - out_dim],
                      w_down, gated, backward_follows):
        return compat.fallback(_ops._expert_down_activated.default, a, w_down, expert_token_indices, expert_offsets,
                               token_index_map, topk_weights, b_down, transposed, gated)
    return combined_rows("down", a, w_down, expert_offsets, token_index_map, topk_weights.get_size()[0],
                         transposed, out_dim, topk_weights, b_down, gated, backward_follows)


@compat.register_lowering(_ops.expert_layer.default, type_promotion_kind=None)
def expert_layer(x, w_gate_up, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                 b_gate_up=None, b_down=None, activation="swiglu", transposed=False, interleaved=False,
                 alpha=CLAMPED_SWIGLU_ALPHA, limit=CLAMPED_SWIGLU_LIMIT, validate=True, w_gate_up_scale=None,
                 w_down_scale=None):
    """The op where its up GEMM runs on the Gluon kernel, whose epilogue writes act(h) (h
    never made), and on FP8 weights (scales given); elsewhere the up projection's template
    writing h, then the down projection as ``expert_down`` lowers it."""
    rows = expert_token_indices.get_size()[0]
    fp8 = w_gate_up_scale is not None or w_down_scale is not None
    if fp8 or not _templates_apply(x, index_positions=_LAYER_INDEX_ARRAYS) \
            or _op_runs_gluon("up", x, rows, w_gate_up.get_size()[2 if transposed else 1], x.get_size()[1]):
        return compat.fallback(_ops.expert_layer.default, x, w_gate_up, w_down, expert_token_indices,
                               expert_offsets, token_index_map, topk_weights, b_gate_up, b_down, activation,
                               transposed, interleaved, alpha, limit, validate, w_gate_up_scale, w_down_scale)
    n_out, reduction = w_gate_up.get_size()[2 if transposed else 1], x.get_size()[1]
    if config.activates_in_up_epilogue(2 * compat.hint(rows) * compat.hint(n_out) * compat.hint(reduction)):
        a = activated_row_gemm(x, w_gate_up, expert_token_indices, expert_offsets, b_gate_up, transposed, rows,
                               activation_code(activation), interleaved, alpha, limit)
        # No backward follows. (Where the down GEMM would run on Gluon, the up GEMM, at least
        # as big, would too and the whole op ran above: the training ops that these fall
        # back to there are never reached from here.)
        return _down_of_activated(a, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                                  b_down, transposed, is_gated(activation), backward_follows=False)
    h = row_gemm("up", x, w_gate_up, expert_token_indices, expert_offsets, b_gate_up, transposed, rows)
    return _down_projection(h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
                            activation, transposed, interleaved, alpha, limit, validate, backward_follows=False)


# --------------------------------------------------------------------------- backward


@compat.register_lowering(_ops.expert_up_backward.default, type_promotion_kind=None)
def expert_up_backward(grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, has_bias,
                       transposed, need_input_grad=True, need_weight_grad=True, validate=True):
    """grad_x as templates where they apply: each routed row's
    dH @ W_e (the up weight read the other way round: ``row_gemm`` with the layout
    flipped), each token's K rows summed with unit weights (``combine``), in column slabs.
    The weight gradients stay the op's kernels (Gluon on Hopper), called for them alone."""
    args = (grad_h, x, w_gate_up, expert_token_indices, expert_offsets, token_index_map, has_bias, transposed)
    # The index arrays are the backward graph's inputs, saved from a forward that checked
    # them (a dispatch, or a forward op's device-side check): the backward ops trust them,
    # as their eager kernels do.
    if not (need_input_grad and _templates_apply(x, index_positions=()) and not compat.known_zero(x.get_size()[0])
            and not _op_runs_gluon("dx", grad_h, grad_h.get_size()[0], x.get_size()[1], grad_h.get_size()[1],
                                   w_gate_up)):
        return compat.fallback(_ops.expert_up_backward.default, *args, need_input_grad, need_weight_grad, validate)
    out_dim = 1 if transposed else 2  # the d of w_gate_up [E, N, d], or of [E, d, N] when transposed
    grad_x = combined_rows("dx", compat.contiguous(grad_h), w_gate_up, expert_offsets, token_index_map,
                           x.get_size()[0], not transposed, out_dim)
    _, grad_w, grad_b = compat.fallback(_ops.expert_up_backward.default, *args, False, need_weight_grad, validate)
    return grad_x, grad_w, grad_b


def _donated_and_last_use(node, position) -> bool:
    """Whether ``node`` (FX argument ``position`` of the op being lowered) is a saved tensor
    the compiled backward owns (a buffer AOTAutograd donated: not visible to the user, and
    its graph refuses ``retain_graph``) that nothing reads after this op."""
    fx_arg = V.graph.current_node.args[position]
    if not isinstance(fx_arg, torch.fx.Node) or len(fx_arg.users) != 1:
        return False
    while not isinstance(node, compat.DonatedBuffer) and hasattr(node, "data"):
        node = node.data
    return isinstance(node, compat.DonatedBuffer)


@compat.register_lowering(_ops.expert_down_backward.default, type_promotion_kind=None)
def expert_down_backward(grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights,
                         b_down, activation, transposed, interleaved, alpha, limit, need_weight_grad=True,
                         validate=True):
    """The op's own kernels; where h is donated and read by nothing else, its in-place form,
    which writes dH over h (as eager autograd does): h and dH never exist at once."""
    overwrite = _donated_and_last_use(h, 1) and h.get_layout().is_contiguous()
    args = (grad_out, h, w_down, expert_token_indices, expert_offsets, token_index_map, topk_weights, b_down,
            activation, transposed, interleaved, alpha, limit, need_weight_grad, validate)
    if not overwrite:
        return compat.fallback(_ops.expert_down_backward.default, *args)
    grad_w, grad_b, grad_tw = compat.fallback(_ops.expert_down_backward_.default, *args)
    return h, grad_w, grad_b, grad_tw
