"""Argument validation shared by the ops' fake functions, their kernels and the front door.

Shape, dtype and device checks run in the fake functions too, so a bad call fails while
``torch.compile`` traces it, with the same message as in eager mode. Nothing here
launches a kernel. Checks that read tensor data (negative or duplicate expert ids) are
the dispatch kernels' own: the portable backend raises at once (``check_topk_id_values``);
the Triton backend writes a flag on the device that ``torch._assert_async`` reads: no
sort, no host sync.

Every error is a ``ValueError`` whose message names the op and the argument.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torch.fx.experimental.symbolic_shapes import guard_or_false

from .activations import ACTIVATIONS, is_gated
from .layouts import linear_dims

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
ID_DTYPES = (torch.int32, torch.int64)
#: The index arrays are int32: at most this many routed (token, k) rows.
MAX_ROUTED_ROWS = 2**31 - 1
#: Dispatch keeps a count table of E columns per chunk of rows; beyond this many experts it
#: would not fit (and no MoE model comes near).
MAX_EXPERTS = 2**16


def definitely(condition) -> bool:
    """Whether a size condition holds for sure. Sizes that only the data decides (the rows
    expert parallelism receives, under torch.compile) leave a check undecided while
    tracing: it then passes, rather than failing the trace (the kernels see real sizes)."""
    if type(condition) is bool and not torch.compiler.is_compiling():  # eager sizes: no symbolic machinery
        return condition
    return guard_or_false(condition)


def fail(op: str, arg: str, message: str) -> None:
    raise ValueError(f"moeblaze.{op}: argument '{arg}' {message}")


def check_tensor(
    op: str,
    arg: str,
    t,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    device: Optional[torch.device] = None,
    shape: Optional[Sequence] = None,
    shape_doc: str = "",  # names of the dimensions, e.g. "[L, K]"
) -> None:
    """Checks type, rank, dtype, device and (entries not None of) ``shape`` of ``t``."""
    if not isinstance(t, torch.Tensor):
        fail(op, arg, f"must be a Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        fail(op, arg, f"must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        fail(op, arg, f"must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        fail(op, arg, f"must be on device {device}, got {t.device}")
    if shape is not None:
        for want, got in zip(shape, t.shape):
            if want is not None and definitely(want != got):
                # Format sizes only here: formatting a symbolic size would specialise it.
                want_s = "(" + ", ".join("*" if s is None else str(int(s)) for s in shape) + ")"
                fail(op, arg, f"must have shape {shape_doc} = {want_s}, got {tuple(t.shape)}")


def check_activation(op: str, activation: str) -> None:
    if activation not in ACTIVATIONS:
        fail(op, "activation", f"must be one of {ACTIVATIONS}, got {activation!r}")


def check_index_arrays(op, expert_token_indices, expert_offsets, token_index_map, num_experts, device):
    """The three arrays of ``dispatch``: int32, 1-D, contiguous, consistent sizes. (Their
    values are checked by the kernels: ``check_index_values`` on the host, a device-side
    assert on CUDA.)"""
    for arg, t in (
        ("expert_token_indices", expert_token_indices),
        ("expert_offsets", expert_offsets),
        ("token_index_map", token_index_map),
    ):
        check_tensor(op, arg, t, ndim=1, dtypes=(torch.int32,), device=device)
        if not t.is_contiguous():
            fail(op, arg, "must be contiguous")
    if expert_offsets.shape[0] != num_experts + 1:
        fail(op, "expert_offsets", f"must have num_experts + 1 = {num_experts + 1} entries, "
             f"got {expert_offsets.shape[0]}")
    if definitely(token_index_map.shape[0] != expert_token_indices.shape[0]):
        fail(op, "token_index_map", f"must have as many entries as expert_token_indices "
             f"({expert_token_indices.shape[0]}), got {token_index_map.shape[0]}")


def check_routed_rows(op, num_tokens, num_rows):
    """``num_rows`` routed rows must be ``num_tokens * K`` for a whole K."""
    if definitely(num_tokens == 0):
        if definitely(num_rows != 0):
            fail(op, "token_index_map", f"must be empty when there are no tokens, got {num_rows} entries")
    elif definitely(num_rows % num_tokens != 0):
        fail(op, "token_index_map", f"must have L*K entries for L={num_tokens} tokens, got {num_rows}")


def index_values_message(op: str) -> str:
    """What a device-side check of the index arrays' values says when it fails (CUDA's
    device assert takes at most 254 characters)."""
    return (f"moeblaze.{op}: index arrays not from dispatch (expert_offsets must start at 0, never decrease, "
            "end <= L*K; expert_token_indices in [0, L); token_index_map in [0, L*K))")


def check_index_values(op, expert_token_indices, expert_offsets, token_index_map, num_tokens):
    """The values of the index arrays, on the host (the portable backend; the Triton backend
    checks them on the device): offsets from 0, non-decreasing, within the rows; token ids
    below ``num_tokens`` (L); ``token_index_map`` a permutation of the rows."""
    rows = token_index_map.shape[0]
    if expert_offsets[0] != 0 or (expert_offsets[1:] < expert_offsets[:-1]).any() or expert_offsets[-1] > rows:
        fail(op, "expert_offsets", f"must start at 0, never decrease and end at most at L*K = {rows} (build it "
             f"with moeblaze.dispatch), got {expert_offsets.tolist() if expert_offsets.numel() <= 16 else 'others'}")
    if rows == 0:
        return
    if expert_token_indices.min() < 0 or expert_token_indices.max() >= num_tokens:
        fail(op, "expert_token_indices", f"must hold token ids in [0, L = {num_tokens}) (build it with "
             "moeblaze.dispatch; topk_weights must be [L, K]), got ids in "
             f"[{int(expert_token_indices.min())}, {int(expert_token_indices.max())}]")
    if (token_index_map.min() < 0 or token_index_map.max() >= rows
            or not torch.bincount(token_index_map.long(), minlength=rows).eq(1).all()):
        fail(op, "token_index_map", f"must be a permutation of the {rows} routed rows (build it with "
             "moeblaze.dispatch)")


# --------------------------------------------------------------------------- dispatch


def check_dispatch(topk_ids, num_experts) -> None:
    check_tensor("dispatch", "topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, shape_doc="[L, K]")
    if not isinstance(num_experts, (int, torch.SymInt)) or num_experts < 1:
        fail("dispatch", "num_experts", f"must be a positive int, got {num_experts!r}")
    if num_experts > MAX_EXPERTS:
        fail("dispatch", "num_experts", f"must be at most {MAX_EXPERTS}, got {num_experts}")
    check_routed_row_count("dispatch", "topk_ids", topk_ids.shape[0] * topk_ids.shape[1])


def check_routed_row_count(op, arg, num_rows):
    """The routed rows must fit the int32 index arrays."""
    if definitely(num_rows > MAX_ROUTED_ROWS):
        fail(op, arg, f"routes {num_rows} (token, k) rows; the int32 index arrays hold at most {MAX_ROUTED_ROWS}: "
             "split the tokens into smaller calls")


def id_value_messages(op: str) -> tuple[str, str]:
    """The messages of the two data errors of ``topk_ids``: a negative id, a real expert id
    repeated in one token's row (sentinels >= E may repeat)."""
    return (f"moeblaze.{op}: argument 'topk_ids' has a negative expert id",
            f"moeblaze.{op}: argument 'topk_ids' has an expert id repeated in one token's row")


def id_values_message(op: str) -> str:
    """The message of the Triton backend's one device-side assertion on ``topk_ids``: either
    data error of ``id_value_messages`` (the portable backend, on the CPU, says which)."""
    return (f"moeblaze.{op}: argument 'topk_ids' has a negative expert id or an expert id repeated in "
            "one token's row")


def check_topk_id_values(op: str, topk_ids: torch.Tensor, num_experts: int) -> None:
    """The data checks of ``topk_ids``, on the host (the portable backend; the Triton
    backend makes them on the device without a sync)."""
    if topk_ids.numel() == 0:
        return
    negative, repeated = id_value_messages(op)
    if (topk_ids < 0).any():
        raise ValueError(negative)
    if topk_ids.shape[1] > 1:  # a single choice per token cannot repeat
        ids = topk_ids.sort(dim=1).values
        if ((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] < num_experts)).any():
            raise ValueError(repeated)


# --------------------------------------------------------------------------- experts


def _check_weight_dtype(op, arg, t, x_arg, x):
    if t.dtype != x.dtype:
        fail(op, arg, f"must have the dtype of '{x_arg}' ({x.dtype}), got {t.dtype}")


def check_fp8_weights(op, x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, transposed):
    """The FP8 weights of an op (``moeblaze_ops.fp8``'s formats): both e4m3 on ``x``'s
    device, both scales given, float32, one per 128 x 128 block of their weight in the
    weight's own layout ([E, out / 128, in / 128], or [E, in / 128, out / 128] when
    ``transposed``), every width a multiple of 128."""
    from .fp8 import BLOCK, E4M3

    for name, w, scale in (("w_gate_up", w_gate_up, w_gate_up_scale), ("w_down", w_down, w_down_scale)):
        check_tensor(op, name, w, ndim=3, dtypes=(E4M3,), device=x.device)
        if scale is None:
            fail(op, f"{name}_scale", f"must be given with the other weight's scales: the float32 scales of "
                 f"{name}'s {BLOCK} x {BLOCK} blocks")
        E, n_out, n_in = linear_dims(w, transposed)
        for side, n in (("output", n_out), ("input", n_in)):
            if definitely(n % BLOCK != 0):
                padded = -(-n // BLOCK) * BLOCK
                fail(op, name, f"must have a multiple of {BLOCK} {side} features in FP8 (the block width), got "
                     f"{n}: pad the weight to {padded} (zeros), or run the layer in bf16")
        blocks = (E, n_in // BLOCK, n_out // BLOCK) if transposed else (E, n_out // BLOCK, n_in // BLOCK)
        check_tensor(op, f"{name}_scale", scale, ndim=3, dtypes=(torch.float32,), device=x.device, shape=blocks,
                     shape_doc="[E, in / 128, out / 128]" if transposed else "[E, out / 128, in / 128]")


def check_expert_up(x, w_gate_up, expert_token_indices, expert_offsets, token_index_map,
                    b_gate_up, transposed, op="expert_up"):
    """Returns ``(E, N, d)``: experts, up-projection width (2I or I), hidden size."""
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, shape_doc="[L, d]")
    dev = x.device
    check_tensor(op, "w_gate_up", w_gate_up, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    _check_weight_dtype(op, "w_gate_up", w_gate_up, "x", x)
    d = x.shape[1]
    E, N, wd = linear_dims(w_gate_up, transposed)
    layout = "[E, d, N]" if transposed else "[E, N, d]"
    if wd != d:
        fail(op, "w_gate_up", f"must have layout {layout} with d={d} (x.shape[1]), got {tuple(w_gate_up.shape)}")
    if b_gate_up is not None:
        check_tensor(op, "b_gate_up", b_gate_up, ndim=2, dtypes=FLOAT_DTYPES, device=dev,
                     shape=(E, N), shape_doc="[E, N]")
        _check_weight_dtype(op, "b_gate_up", b_gate_up, "x", x)
    check_index_arrays(op, expert_token_indices, expert_offsets, token_index_map, E, dev)
    check_routed_rows(op, x.shape[0], token_index_map.shape[0])
    return E, N, d


def check_expert_down(h, w_down, expert_token_indices, expert_offsets, token_index_map,
                      topk_weights, b_down, activation, transposed, op="expert_down"):
    """Returns ``(E, d, I)``: experts, hidden size, intermediate size."""
    check_activation(op, activation)
    check_tensor(op, "h", h, ndim=2, dtypes=FLOAT_DTYPES, shape_doc="[L*K, N]")
    dev = h.device
    N = h.shape[1]
    if is_gated(activation) and N % 2 != 0:
        fail(op, "h", f"must have an even number of columns (2I) for the gated activation "
             f"{activation!r}, got {N}")
    I = N // 2 if is_gated(activation) else N
    check_tensor(op, "w_down", w_down, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    _check_weight_dtype(op, "w_down", w_down, "h", h)
    E, d, wi = linear_dims(w_down, transposed)
    layout = "[E, I, d]" if transposed else "[E, d, I]"
    if wi != I:
        fail(op, "w_down", f"must have layout {layout} with I={I} (from h and activation "
             f"{activation!r}), got {tuple(w_down.shape)}")
    check_tensor(op, "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=dev,
                 shape_doc="[L, K]")
    if b_down is not None:
        check_tensor(op, "b_down", b_down, ndim=2, dtypes=FLOAT_DTYPES, device=dev,
                     shape=(E, d), shape_doc="[E, d]")
        _check_weight_dtype(op, "b_down", b_down, "h", h)
    check_index_arrays(op, expert_token_indices, expert_offsets, token_index_map, E, dev)
    L, K = topk_weights.shape
    if definitely(L * K != token_index_map.shape[0]):
        fail(op, "topk_weights", f"must have shape [L, K] with L*K = {token_index_map.shape[0]} "
             f"routed rows, got {tuple(topk_weights.shape)}")
    if definitely(h.shape[0] != token_index_map.shape[0]):
        fail(op, "h", f"must have one row per routed row ({token_index_map.shape[0]}), got {h.shape[0]}")
    return E, d, I


def check_grad(op, arg, grad, shape, device):
    """An incoming gradient: floating point, on ``device``, of ``shape``. (Takes the shape
    rather than a tensor like it: building one would allocate an [L*K, N] buffer.)"""
    check_tensor(op, arg, grad, ndim=len(shape), dtypes=FLOAT_DTYPES, device=device, shape=tuple(shape))


# --------------------------------------------------------------------------- front door


def check_moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down,
                      activation, transposed):
    """Cross-argument checks of ``moe_experts``, named as the caller named them."""
    op = "moe_experts"
    check_activation(op, activation)
    dev = _layer_device(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w_gate_up=w_gate_up, w_down=w_down,
                        b_gate_up=b_gate_up, b_down=b_down)
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, device=dev, shape_doc="[L, d]")
    L = x.shape[0]
    check_tensor(op, "topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, device=dev,
                 shape=(L, None), shape_doc="[L, K] with L of x")
    check_routed_row_count(op, "topk_ids", topk_ids.shape[0] * topk_ids.shape[1])
    K = topk_ids.shape[1]
    check_tensor(op, "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=dev,
                 shape=(L, K), shape_doc="[L, K] of topk_ids")
    check_tensor(op, "w_gate_up", w_gate_up, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor(op, "w_down", w_down, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    E, N, d_up = linear_dims(w_gate_up, transposed)
    E_down, d_down, wi = linear_dims(w_down, transposed)
    if not 1 <= E <= MAX_EXPERTS:
        fail(op, "w_gate_up", f"must hold between 1 and {MAX_EXPERTS} experts (dimension 0), got {E}")
    if E_down != E:
        fail(op, "w_down", f"must have as many experts as w_gate_up ({E}), got {E_down}")
    if is_gated(activation) and N % 2 != 0:
        fail(op, "w_gate_up", f"must have 2I output columns for the gated activation "
             f"{activation!r}, got {N}")
    I = N // 2 if is_gated(activation) else N
    if wi != I:
        fail(op, "w_down", f"must have intermediate size I={I} (from w_gate_up and activation "
             f"{activation!r}), got shape {tuple(w_down.shape)}")
    for arg, b, width in (("b_gate_up", b_gate_up, N), ("b_down", b_down, x.shape[1])):
        if b is not None:
            check_tensor(op, arg, b, ndim=2, dtypes=FLOAT_DTYPES, device=dev, shape=(E, width),
                         shape_doc="[E, N]" if arg == "b_gate_up" else "[E, d]")
    d = x.shape[1]
    if d_up != d:
        fail(op, "w_gate_up", f"must have hidden size d={d} (x.shape[1]), got shape {tuple(w_gate_up.shape)}")
    if d_down != d:
        fail(op, "w_down", f"must have hidden size d={d} (x.shape[1]), got shape {tuple(w_down.shape)}")
    for arg, t in (("w_gate_up", w_gate_up), ("w_down", w_down), ("b_gate_up", b_gate_up), ("b_down", b_down)):
        if t is not None:
            _check_weight_dtype(op, arg, t, "x", x)
    return E, N, d


def _layer_device(**tensors):
    """The device most of the layer's tensors are on (x's on a tie), so that a check names
    the one tensor elsewhere rather than everything else."""
    devices = [t.device for t in tensors.values() if isinstance(t, torch.Tensor)]
    x = tensors["x"]
    first = x.device if isinstance(x, torch.Tensor) else (devices[0] if devices else None)
    distinct = set(devices)
    if len(distinct) <= 1:  # the usual case, without the vote
        return first
    return max(distinct, key=lambda d: (devices.count(d), d == first))
