"""Decode mode: the experts' forward at inference token counts, against the bytes it must read.

At decode sizes (a few to a few thousand tokens) an experts layer is bound by memory: each
call reads the weights of every expert its tokens hit. So for each shape (``DECODE_SHAPES``)
and token count T this mode times one forward without gradients (``torch.inference_mode``,
uniform routing, bf16 on CUDA, fp32 on CPU) and sets it beside a floor: the bytes of the
distinct experts the routing hits, plus ``x`` and the output, at the card's nominal
bandwidth (``--nominal-tbps``) and at the read bandwidth measured in the same run
(``buf.sum()`` over a large buffer).

Peers on CUDA, each what an inference server would run: ``moeblaze_cudagraphs``
(``moe_experts`` under ``torch.compile(mode="reduce-overhead", fullgraph=True)``, the
forward benchmark's own peer), ``moeblaze_graph`` (eager ``moe_experts`` captured into a
``torch.cuda.CUDAGraph`` and replayed: no host work at all), ``moeblaze_fp8_graph`` (the
same on FP8 weights, below) and ``grouped_mm_compiled`` (HF's ``grouped_mm`` experts under
``mode="reduce-overhead"``, the forward benchmark's ``hf_grouped_mm_cudagraphs``). On CPU,
the mode's own check, eager ``moeblaze``, ``moeblaze_fp8`` and eager ``grouped_mm``.

The FP8 peers run ``moe_experts`` on e4m3 weights with one fp32 scale per 128 x 128 block
(``moeblaze_ops.fp8``), as a fine-grained FP8 checkpoint stores them, and only where every
width of the shape (d and I) is a multiple of 128: elsewhere they have no rows. Each copy of
the weights is quantized once, when it is made, never in a timed call (quantizing reads the
bf16 weights: as many bytes as the layer). Their floor is their own: the hit experts' e4m3
weights (one byte an element) and block scales, plus ``x`` and the output in the
activations' dtype (``fp8_floor_bytes``), about half the bf16 floor.

The L2 cache must not hold what one call reads, or a replay would read weights from L2 and
beat the memory floor. So the mode keeps several copies ("draws") of the weights and of the
inputs, enough that the weights' bytes exceed four L2s (at least two, at most 40% of the free
memory, which also holds the e4m3 copies where FP8 applies), and each timed call uses the next
draw. A graph's inputs are fixed addresses, and copying weights into them would itself cost
bandwidth, so each draw has its own graph.

A server replays a whole model step as one graph, not a graph a layer. So on CUDA each
graph peer runs a stack of ``--layers-per-graph`` layers (default 8) in one graph, the draws
in turn, and a layer's time is the stack's over its layers: the host's work per replay
(CUDA-graph trees check their inputs in Python on every call) is spread over the stack as
over a model's layers, where one graph a layer would charge all of it to one layer at the
smallest T. ``--layers-per-graph 1`` times one layer a graph.

Before timing, every peer's output on every draw is compared with eager ``grouped_mm``'s
(HF's eager loop without transformers); a difference beyond ``TOLERANCE`` (the FP8 peers:
``FP8_TOLERANCE``, since their quantization moves the output by 5-7%) raises
``OutputMismatch``: a wrong layer's time is no result.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import moeblaze_ops

from ..testing import rel_err
from .configs import DECODE_SHAPES, DECODE_TOKENS
from .console import emit, note, progress
from .implementations import HFExpertsModule, fp8_fits, fp8_layer, fp8_weights, peers
from .report import title

__all__ = ["CPU_PEERS", "CUDA_PEERS", "DECODE_PEER_NAMES", "DEFAULT_SHAPES", "DecodeOptions", "Draw",
           "FP8_PEERS", "FP8_TOLERANCE", "OutputMismatch", "TOLERANCE", "bench_decode", "build_draws",
           "capture_graph", "decode_table", "distinct_experts", "draw_count", "expert_bytes", "fp8_applies",
           "fp8_expert_bytes", "fp8_floor_bytes", "floor_bytes", "make_weights", "plot_decode", "mark_static",
           "quantize_weights", "read_bandwidth", "run_decode", "stack_call", "stacked_layers", "time_per_call_us"]

#: The peers timed on CUDA, in the tables' order.
CUDA_PEERS = ("moeblaze_cudagraphs", "moeblaze_graph", "moeblaze_fp8_graph", "grouped_mm_compiled")
#: The peers timed on CPU (no CUDA graphs there): the mode's own smoke check.
CPU_PEERS = ("moeblaze", "moeblaze_fp8", "grouped_mm")
#: The peers of the FP8 layer (e4m3 weights, ``Draw.fp8_inputs``): rows only where
#: ``fp8_applies``, their own floor and tolerance.
FP8_PEERS = ("moeblaze_fp8_graph", "moeblaze_fp8")
#: Every decode peer: the names ``--skip`` takes in decode mode.
DECODE_PEER_NAMES = CUDA_PEERS + CPU_PEERS
#: The shapes a run measures unless ``--configs`` names others.
DEFAULT_SHAPES = ("mixtral_decode", "qwen3_a3b_decode")
#: Largest relative error (norm of the difference over the norm of grouped_mm's output) a
#: peer may show before the run refuses to time it. fp32: only the summation order differs;
#: bf16: the peers round h (or act(h)) to bf16 at different points.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
#: The FP8 peers' largest relative error against grouped_mm's (bf16 or fp32) output, in any
#: dtype: e4m3's 3 mantissa bits, on the weights and on the activations of both GEMMs, move
#: the output by 5-7% on these random layers; a wrong FP8 layer is off by order one.
FP8_TOLERANCE = 0.1

# Which callable of ``implementations.peers`` each decode peer times; moeblaze_graph
# captures that one's eager "moeblaze" into a graph of its own (``capture_graph``).
_SOURCE = {"moeblaze_cudagraphs": "moeblaze_cudagraphs", "moeblaze_graph": "moeblaze",
           "grouped_mm_compiled": "hf_grouped_mm_cudagraphs", "moeblaze": "moeblaze", "grouped_mm": "hf_grouped_mm"}
_GROUPED_MM = ("grouped_mm_compiled", "grouped_mm")  # the baseline of "vs grouped_mm"
_GRAPHED = ("moeblaze_graph", "moeblaze_fp8_graph")  # eager calls captured by capture_graph
_H100_L2_BYTES = 50 * 2**20  # assumed where the device properties do not say
_MAX_DRAWS = 16  # each draw is one more graph (and compile) per peer: enough for tiny shapes


class OutputMismatch(RuntimeError):
    """A peer's output differs from grouped_mm's by more than ``TOLERANCE``: the run stops
    rather than time a layer that computes something else."""


@dataclass(frozen=True)
class DecodeOptions:
    """What one decode run measures and how: shapes, token counts, device, the nominal
    bandwidth of the floor, the bandwidth buffer's size (None: 4096 MB on CUDA, 64 MB on
    CPU), timed calls per repeat and repeats, peers left out, the inputs' seed, and the
    layers each graph peer's graph runs (``stacked_layers``)."""

    shapes: tuple = DEFAULT_SHAPES
    tokens: tuple = DECODE_TOKENS
    device: str = "cuda"
    nominal_tbps: float = 3.35
    bandwidth_mb: float | None = None
    calls: int = 200
    repeats: int = 5
    skip: frozenset = frozenset()
    seed: int = 0
    layers_per_graph: int = 8

    @property
    def on_cuda(self) -> bool:
        """Whether the run times CUDA graphs with CUDA events."""
        return self.device == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        """bf16 on CUDA, as served; fp32 on CPU, where the peers' outputs then agree to 1e-5."""
        return torch.bfloat16 if self.on_cuda else torch.float32

    @property
    def peer_names(self) -> tuple:
        """The peers this run times, in order."""
        return tuple(p for p in (CUDA_PEERS if self.on_cuda else CPU_PEERS) if p not in self.skip)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffer whose ``sum()`` measures the read bandwidth."""
        mb = self.bandwidth_mb if self.bandwidth_mb is not None else (4096 if self.on_cuda else 64)
        return int(mb * 2**20)


@dataclass
class Draw:
    """One copy of a layer's inputs: ``x [T, d]``, ``ids``/``w [T, K]`` (uniform routing),
    and one copy of the weights, ``w_gate_up [E, 2I, d]``, ``w_down [E, d, I]``; where FP8
    applies, also that copy in e4m3 with its block scales (``quantize_weights``; else None)."""

    x: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    w_gate_up8: torch.Tensor | None = None
    w_down8: torch.Tensor | None = None
    w_gate_up_scale: torch.Tensor | None = None
    w_down_scale: torch.Tensor | None = None

    @property
    def inputs(self) -> tuple:
        """``(x, ids, w, w_gate_up, w_down)``: the arguments of ``implementations.peers``."""
        return self.x, self.ids, self.w, self.w_gate_up, self.w_down

    @property
    def fp8_inputs(self) -> tuple:
        """``(x, ids, w, w_gate_up8, w_down8, w_gate_up_scale, w_down_scale)``: the arguments
        of the FP8 layer (``fp8_layer``)."""
        return self.x, self.ids, self.w, self.w_gate_up8, self.w_down8, self.w_gate_up_scale, self.w_down_scale


def expert_bytes(d, I, element_size):
    """Bytes of one gated expert's weights: ``gate_up`` [2I, d] and ``down`` [d, I]."""
    return 3 * d * I * element_size


def fp8_applies(d, I):
    """Whether the FP8 peers run at widths ``d`` and ``I`` (``implementations.fp8_fits``)."""
    return fp8_fits(d, I)


def fp8_expert_bytes(d, I):
    """Bytes of one gated expert's FP8 weights: ``gate_up`` [2I, d] and ``down`` [d, I] in
    e4m3 (one byte an element) plus their fp32 scales, one per 128 x 128 block."""
    blocks = 3 * d * I // moeblaze_ops.fp8.BLOCK**2
    return 3 * d * I + 4 * blocks


def distinct_experts(ids):
    """How many distinct experts ``ids`` routes to (a host sync: setup only, never timed)."""
    return int(torch.unique(ids).numel())


def draw_count(weight_bytes, l2_bytes, free_bytes, min_draws=2, l2_factor=4, memory_fraction=0.4,
               max_draws=_MAX_DRAWS, held_bytes=None):
    """How many copies of weights of ``weight_bytes`` each to keep: enough that together
    they exceed ``l2_factor`` L2 caches (unknown L2: ``min_draws``), at least ``min_draws``,
    at most ``max_draws``, and no more than ``memory_fraction`` of ``free_bytes`` (unknown:
    no limit) allows, though never fewer than one. ``held_bytes``: what one copy holds in
    memory where that is more than a call reads (its bf16 and e4m3 weights; default
    ``weight_bytes``)."""
    count = min_draws if l2_bytes is None else max(min_draws, math.ceil(l2_factor * l2_bytes / weight_bytes))
    count = min(count, max_draws)
    if free_bytes is not None:
        count = min(count, int(memory_fraction * free_bytes // (held_bytes or weight_bytes)))
    return max(count, 1)


def _device_memory(device):
    """(L2 bytes, free bytes) of ``device``; (None, None) off CUDA, where neither is known."""
    if device != "cuda":
        return None, None
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or None
    if l2 is None:
        note(f"bench: the device does not report its L2 size; assuming {_H100_L2_BYTES / 2**20:.0f} MB (H100)")
        l2 = _H100_L2_BYTES
    return l2, torch.cuda.mem_get_info()[0]


def make_weights(d, I, E, count, dtype, device, seed):
    """``count`` independent random copies of a SwiGLU layer's weights, ``(w_gate_up, w_down)``
    each, scaled as ``configs.make_inputs`` scales them (outputs of order one)."""
    copies = []
    for i in range(count):
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
        # In place: a second full-size temporary of Mixtral's weights would cost gigabytes.
        w_gate_up = torch.randn(E, 2 * I, d, device=device, dtype=dtype, generator=g).mul_(d ** -0.5)
        w_down = torch.randn(E, d, I, device=device, dtype=dtype, generator=g).mul_(I ** -0.5)
        copies.append((w_gate_up, w_down))
    return copies


def quantize_weights(weights):
    """The e4m3 copy of each copy of ``weights`` (``implementations.fp8_weights``), made
    once per copy at setup."""
    return [fp8_weights(w_gate_up, w_down) for w_gate_up, w_down in weights]


def build_draws(T, K, weights, dtype, device, seed, fp8=None):
    """One ``Draw`` per copy of ``weights``: fresh ``x`` and uniform routing (top-K of the
    softmax of random logits, as ``configs.make_inputs``) of T tokens for each, so the
    draws also differ in which experts they hit. ``fp8``: ``quantize_weights(weights)``,
    which the draws then carry (None: no FP8 peers)."""
    draws = []
    for i, (w_gate_up, w_down) in enumerate(weights):
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + T * 1_009 + i)
        E, d = w_gate_up.shape[0], w_gate_up.shape[-1]
        x = torch.randn(T, d, device=device, dtype=dtype, generator=g)
        w, ids = torch.randn(T, E, device=device, generator=g).softmax(-1).topk(K, dim=-1)
        draws.append(Draw(x, ids, w, w_gate_up, w_down, *(fp8[i] if fp8 is not None else ())))
    return draws


def floor_bytes(draws, d, I, element_size):
    """(distinct experts of each draw, the mean bytes one call must move): the hit experts'
    weights, read once, plus ``x`` read and the output written. The mean over the draws,
    since each timed call uses the next draw."""
    return _moved(draws, expert_bytes(d, I, element_size), d, element_size)


def fp8_floor_bytes(draws, d, I, element_size):
    """``floor_bytes`` of the FP8 layer: the hit experts' e4m3 weights and block scales
    (``fp8_expert_bytes``), plus ``x`` read and the output written in the activations'
    ``element_size``."""
    return _moved(draws, fp8_expert_bytes(d, I), d, element_size)


def _moved(draws, per_expert, d, element_size):
    """(distinct experts of each draw, their mean times ``per_expert`` plus ``x`` and the output)."""
    counts = [distinct_experts(draw.ids) for draw in draws]
    T = draws[0].x.shape[0]
    return counts, statistics.fmean(counts) * per_expert + 2 * T * d * element_size


def _sync(on_cuda):
    if on_cuda:
        torch.cuda.synchronize()


def read_bandwidth(nbytes, dtype, device, repeats=10):
    """Bytes per second ``buf.sum()`` reads from a buffer of ``nbytes`` (median of ``repeats``
    calls after a warm-up): the bandwidth this card reaches, for the floor beside the
    nominal one."""
    on_cuda = device == "cuda"
    buf = torch.ones(max(nbytes // dtype.itemsize, 1), dtype=dtype, device=device)
    buf.sum()
    samples = []
    for _ in range(repeats):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            buf.sum()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            buf.sum()
            samples.append(time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / statistics.median(samples)


def capture_graph(fn):
    """``fn`` (no arguments) captured into a ``torch.cuda.CUDAGraph``: returns a callable
    that replays it and returns the graph's output. Warmed up first on a side stream, as
    capture requires: Triton compiles and the launchers are cached outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    replay.graph = graph  # the graph lives as long as its caller holds this function
    return replay


def mark_static(draws):
    """Marks every tensor of the draws a static address for ``torch.compile``, so
    ``reduce-overhead`` reads them where they are (re-recording one graph per draw) instead
    of copying them into the graph's own input buffers on every call, which for the weights
    would cost as much bandwidth as the layer itself."""
    for draw in draws:
        for t in draw.inputs:
            torch._dynamo.mark_static_address(t)


def _stack_layer(peer):
    """The plain layer function of graph peer ``peer``, which its stack repeats: ``(x, ids,
    w, w_gate_up, w_down) -> out``, or ``fp8_layer`` for an FP8 peer."""
    if peer in ("moeblaze_cudagraphs", "moeblaze_graph"):
        return moeblaze_ops.moe_experts
    if peer in FP8_PEERS:
        return fp8_layer
    from transformers.integrations.moe import grouped_mm_experts_forward

    return lambda x, ids, w, w_gate_up, w_down: grouped_mm_experts_forward(
        HFExpertsModule(w_gate_up, w_down), x, ids, w)


def stacked_layers(layer, draws, layers, fp8=False):
    """``(model, args)``: ``model(*args)`` runs ``layer`` ``layers`` times, on the draws in
    turn (layer i on draw i mod len(draws)), and returns every layer's output (so that no
    compiler drops a layer whose output nothing reads). ``fp8``: ``layer`` takes the draws'
    ``fp8_inputs`` rather than their ``inputs``."""
    order = [draws[i % len(draws)] for i in range(layers)]
    inputs = [draw.fp8_inputs if fp8 else draw.inputs for draw in order]
    width = len(inputs[0])

    def model(*args):
        return tuple(layer(*args[i * width:(i + 1) * width]) for i in range(layers))

    return model, [t for draw_inputs in inputs for t in draw_inputs]


def stack_call(peer, draws, layers):
    """The one call of graph peer ``peer`` that replays a stack of ``layers`` layers (on CPU
    tensors, ``moeblaze_graph`` and ``moeblaze_fp8_graph`` run the stack eagerly: no CUDA
    graphs there)."""
    model, args = stacked_layers(_stack_layer(peer), draws, layers, fp8=peer in FP8_PEERS)
    if peer in _GRAPHED:
        return capture_graph(lambda: model(*args)) if args[0].is_cuda else (lambda: model(*args))
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args)

    return call


def _peer_call(peer, fns):
    """The call of decode peer ``peer`` on one draw, from that draw's ``peers()`` callables."""
    source = _SOURCE[peer]
    if source not in fns:
        raise LookupError(f"{source} is not offered here (transformers not importable?)")
    return capture_graph(fns[source]) if peer == "moeblaze_graph" else fns[source]


def _fp8_call(peer, draw):
    """The call of FP8 peer ``peer`` on one draw: the FP8 layer on the draw's e4m3 weights,
    captured into a graph for ``moeblaze_fp8_graph``."""
    def call():
        return fp8_layer(*draw.fp8_inputs)

    return capture_graph(call) if peer in _GRAPHED and draw.x.is_cuda else call


def _reference(fns):
    """Eager grouped_mm's call on one draw: the output every peer must match (HF's eager
    loop where transformers is missing)."""
    return fns.get("hf_grouped_mm", fns["hf_eager"])


def time_per_call_us(calls, n_calls, repeats, on_cuda):
    """Microseconds per call, median of ``repeats`` runs of at least ``n_calls`` calls that go
    round ``calls`` (one per draw) in order, each draw as often: CUDA events around each run
    on CUDA (host gaps count, as a server's would), ``perf_counter`` elsewhere."""
    n = math.ceil(max(n_calls, 1) / len(calls)) * len(calls)
    order = [calls[i % len(calls)] for i in range(n)]
    samples = []
    for _ in range(repeats):
        _sync(on_cuda)
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for call in order:
                call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / n)
        else:
            t0 = time.perf_counter()
            for call in order:
                call()
            samples.append((time.perf_counter() - t0) * 1e6 / n)
    return statistics.median(samples)


def _as_outputs(result) -> tuple:
    """A call's outputs: a stack's tuple, or one layer's tensor alone."""
    return result if isinstance(result, tuple) else (result,)


def _checked(peer, calls, refs, tolerance, where):
    """``(calls, the largest relative error of their outputs against refs)``. Each call runs
    three times first (a reduce-overhead peer warms up, records, then replays), so the
    outputs compared are the ones the timed calls make: one per call, or one per layer of
    a stacked call, in ``refs``' order. Raises ``OutputMismatch`` beyond ``tolerance``."""
    for call in calls:
        for _ in range(3):
            call()
    outputs = [out for call in calls for out in _as_outputs(call())]
    errors = [rel_err(out, ref) for out, ref in zip(outputs, refs, strict=True)]
    bad = [i for i, error in enumerate(errors) if not error <= tolerance]  # NaN is bad too
    if bad:
        raise OutputMismatch(f"{where}: {peer}'s output differs from grouped_mm's by {errors[bad[0]]:.3g} "
                             f"(relative; tolerance {tolerance:g}) at output {bad[0]} (a draw's, or a stack's "
                             "layer's): not timed")
    return calls, max(errors)


def _floor_fields(moved, opts, bandwidth):
    """A row's floor: ``moved`` bytes, and their microseconds at the nominal and measured bandwidths."""
    return dict(floor_bytes=moved, floor_us_nominal=moved / (opts.nominal_tbps * 1e12) * 1e6,
                floor_us_measured=moved / bandwidth * 1e6)


def _measure_tokens(opts, shape, T, weights, bandwidth):
    """Rows of one shape at T tokens: one per peer, with the floor beside each.
    ``weights``: ``(copies, their quantize_weights or None)``."""
    d, I, E, K = DECODE_SHAPES[shape]
    copies, fp8 = weights
    draws = build_draws(T, K, copies, opts.dtype, opts.device, opts.seed, fp8=fp8)
    if opts.on_cuda:
        mark_static(draws)
    element_size = draws[0].x.element_size()
    counts, moved = floor_bytes(draws, d, I, element_size)
    base = dict(shape=shape, T=T, d=d, I=I, E=E, K=K, draws=len(draws), distinct_experts=statistics.fmean(counts),
                distinct_experts_per_draw=counts, **_floor_fields(moved, opts, bandwidth))
    fp8_floor = _floor_fields(fp8_floor_bytes(draws, d, I, element_size)[1], opts, bandwidth) if fp8 else None
    # fp8=False: the FP8 peers here read the draw's own e4m3 weights (``Draw.fp8_inputs``), quantized once
    # per copy; peers() would quantize (and hold) another copy per draw at every T.
    fns_per_draw = [peers(*draw.inputs, cuda_graphs=opts.on_cuda, fp8=False) for draw in draws]
    refs = [_reference(fns)().clone() for fns in fns_per_draw]
    rows = []
    for peer in opts.peer_names:
        is_fp8 = peer in FP8_PEERS
        if is_fp8 and fp8 is None:
            continue  # a width that is not a multiple of 128: no FP8 layer to time
        row = dict(base, peer=peer, **(fp8_floor if is_fp8 else {}))
        tolerance = FP8_TOLERANCE if is_fp8 else TOLERANCE[opts.dtype]
        try:
            layers = opts.layers_per_graph if peer in CUDA_PEERS else 1
            if layers > 1:  # one call, layer i on draw i mod len(draws)
                calls, refs_of = [stack_call(peer, draws, layers)], [refs[i % len(draws)] for i in range(layers)]
            elif is_fp8:
                calls, refs_of = [_fp8_call(peer, draw) for draw in draws], refs
            else:
                calls, refs_of = [_peer_call(peer, fns) for fns in fns_per_draw], refs
            calls, row["rel_err_vs_grouped_mm"] = _checked(peer, calls, refs_of, tolerance, f"{shape} T={T}")
            row["layers_per_graph"] = layers
            row["us"] = time_per_call_us(calls, math.ceil(opts.calls / layers), opts.repeats, opts.on_cuda) / layers
        except OutputMismatch:
            raise
        except Exception as e:  # noqa: BLE001 - one peer that cannot run leaves the others' rows
            reason = (str(e).strip().splitlines() or [""])[0]
            note(f"bench: {peer} not timed at {shape} T={T}: {type(e).__name__}: {reason}")
            row.update(us=float("nan"), rel_err_vs_grouped_mm=float("nan"), error=f"{type(e).__name__}: {reason}")
        finally:
            calls = None  # the graphs go before the next peer captures its own
        row["share_of_floor_measured"] = row["floor_us_measured"] / row["us"]
        row["share_of_floor_nominal"] = row["floor_us_nominal"] / row["us"]
        rows.append(row)
    baseline = next((r["us"] for r in rows if r["peer"] in _GROUPED_MM), float("nan"))
    for row in rows:
        row["speedup_vs_grouped_mm"] = baseline / row["us"]
        emit(row)
    return rows


def _release(on_cuda):
    """Drops compiled code and CUDA-graph trees, and the cached blocks they held."""
    torch._dynamo.reset()
    if on_cuda:
        torch.cuda.empty_cache()


def bench_decode(opts):
    """Runs the decode measurements: returns the run's record (device, versions are the
    caller's), with the measured read bandwidth and one row per (shape, T, peer)."""
    bandwidth = read_bandwidth(opts.buffer_bytes, opts.dtype, opts.device)
    _release(opts.on_cuda)  # the bandwidth buffer's gigabytes go back before the weights come
    note(f"bench: read bandwidth {bandwidth / 1e12:.3f} TB/s (sum of {opts.buffer_bytes / 2**20:.0f} MB), "
         f"nominal {opts.nominal_tbps} TB/s")
    l2, _ = _device_memory(opts.device)
    result = dict(mode="decode", dtype=str(opts.dtype).removeprefix("torch."), nominal_tbps=opts.nominal_tbps,
                  measured_tbps=bandwidth / 1e12, bandwidth_buffer_bytes=opts.buffer_bytes, l2_bytes=l2,
                  calls=opts.calls, repeats=opts.repeats, layers_per_graph=opts.layers_per_graph, rows=[])
    work = [(shape, T) for shape in opts.shapes for T in opts.tokens]
    weights, weights_of = None, None
    # A compiled peer may compile once per draw (where Dynamo guards on the identity of what
    # its closure holds): room for every draw beyond the default limit of 8.
    recompiles = torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit,
                                                                2 * _MAX_DRAWS))
    with recompiles, torch.inference_mode():
        for shape, T in progress(work, "decode"):
            if weights_of != shape:
                weights = None  # the last shape's copies go before this shape's come
            # Each T compiles afresh: static shapes, no recompile limit across T, and the last
            # T's CUDA-graph trees and their memory pool freed.
            _release(opts.on_cuda)
            if weights is None:
                weights, weights_of = _shape_weights(opts, shape), shape
            result["rows"] += _measure_tokens(opts, shape, T, weights, bandwidth)
        weights = None
        _release(opts.on_cuda)
    return result


def _shape_weights(opts, shape):
    """``(copies, their quantize_weights or None)``: the draws' weights of ``shape``, and
    where ``fp8_applies`` their e4m3 copies, as many as ``draw_count`` allows, with a note
    when the memory cap leaves fewer than the L2 needs."""
    d, I, E, _ = DECODE_SHAPES[shape]
    with_fp8 = fp8_applies(d, I)
    held = E * expert_bytes(d, I, opts.dtype.itemsize)
    # The FP8 peers read the e4m3 copies alone, the smallest: enough of them to exceed the
    # L2s, while memory holds both copies. (quantize_blocks' fp32 temporaries, a few times
    # one bf16 weight, come and go within the 60% the cap leaves.)
    per_draw = E * fp8_expert_bytes(d, I) if with_fp8 else held
    if with_fp8:
        held += per_draw
    l2, free = _device_memory(opts.device)
    count = draw_count(per_draw, l2, free, held_bytes=held)
    if l2 is not None and count * per_draw < 4 * l2:
        note(f"bench: {shape}: {count} draws of {per_draw / 2**20:.0f} MB{' (e4m3)' if with_fp8 else ''} stay "
             f"under four L2s ({4 * l2 / 2**20:.0f} MB); part of what a call reads may come from L2")
    copies = make_weights(d, I, E, count, opts.dtype, opts.device, opts.seed)
    return copies, quantize_weights(copies) if with_fp8 else None


def _by_shape_and_tokens(rows):
    """(shape, T) -> {peer: row}, in the rows' order."""
    grouped = {}
    for r in rows:
        grouped.setdefault((r["shape"], r["T"]), {})[r["peer"]] = r
    return grouped


def _us(value):
    return "failed" if math.isnan(value) else f"{value:.1f}"


def _is_fp8(peer):
    """Whether ``peer`` (a row's name, perhaps of an older run's JSON) runs the FP8 layer,
    whose floor is its own."""
    return "fp8" in peer


def _bf16_floor_row(by_peer):
    """A row of one (shape, T) that carries the bf16 floor (the FP8 peers' is their own), or None."""
    return next((r for p, r in by_peer.items() if not _is_fp8(p)), None)


def _fastest(rows):
    """The row of least ``us`` of those timed, or None."""
    timed = [r for r in rows if not math.isnan(r["us"])]
    return min(timed, key=lambda r: r["us"]) if timed else None


def decode_table(rows):
    """Markdown table of ``bench_decode``'s rows: one line per (shape, T) with both floors,
    each peer's microseconds, the best (bf16) moeblaze peer's share of the measured-bandwidth
    floor and its speedup over grouped_mm, then the FP8 floor at the measured bandwidth and
    the best FP8 peer's share of it ("-" without FP8 rows)."""
    peer_names = list(dict.fromkeys(r["peer"] for r in rows))
    header = ["shape", "T", "experts hit", "floor us (nominal)", "floor us (measured bw)",
              *(f"{p} us" for p in peer_names), "moeblaze best: share of measured floor", "vs grouped_mm",
              "fp8 floor us (measured bw)", "fp8: share of its floor"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for (shape, T), by_peer in _by_shape_and_tokens(rows).items():
        first = _bf16_floor_row(by_peer)
        fp8_rows = [r for p, r in by_peer.items() if _is_fp8(p)]
        best = _fastest([r for p, r in by_peer.items() if p.startswith("moeblaze") and not _is_fp8(p)])
        fp8_best = _fastest(fp8_rows)
        floors = ([f"{first['floor_us_nominal']:.1f}", f"{first['floor_us_measured']:.1f}"] if first
                  else ["-", "-"])
        cells = [shape, str(T), f"{next(iter(by_peer.values()))['distinct_experts']:.2f}", *floors,
                 *(_us(by_peer[p]["us"]) if p in by_peer else "-" for p in peer_names),
                 f"{best['share_of_floor_measured']:.0%} ({best['peer']})" if best else "-",
                 f"{best['speedup_vs_grouped_mm']:.2f}x" if best and not math.isnan(best["speedup_vs_grouped_mm"])
                 else "-",
                 f"{fp8_rows[0]['floor_us_measured']:.1f}" if fp8_rows else "-",
                 f"{fp8_best['share_of_floor_measured']:.0%} ({fp8_best['peer']})" if fp8_best else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_decode(rows, path):
    """Latency against T, log-log, one panel per shape: a line per peer and the two floors
    (and the FP8 floor at the measured bandwidth where there are FP8 rows); saved to
    ``path``. False (nothing written) where matplotlib is not importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    grouped = _by_shape_and_tokens(rows)
    shapes = list(dict.fromkeys(shape for shape, _ in grouped))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        tokens = [T for s, T in grouped if s == shape]
        cells = [grouped[(shape, T)] for T in tokens]
        for peer in dict.fromkeys(p for by_peer in cells for p in by_peer):
            ax.plot(tokens, [by_peer[peer]["us"] if peer in by_peer else float("nan") for by_peer in cells],
                    marker="o", label=peer)
        bf16_rows = [_bf16_floor_row(by_peer) for by_peer in cells]
        for key, style, label in (("floor_us_measured", "k--", "floor (measured bw)"),
                                  ("floor_us_nominal", "k:", "floor (nominal bw)")):
            ax.plot(tokens, [r[key] if r else float("nan") for r in bf16_rows], style, label=label)
        fp8_rows = [next((r for p, r in by_peer.items() if _is_fp8(p)), None) for by_peer in cells]
        if any(fp8_rows):
            ax.plot(tokens, [r["floor_us_measured"] if r else float("nan") for r in fp8_rows], "r--",
                    label="fp8 floor (measured bw)")
        ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="us per call", title=shape)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_decode(opts, out, record):
    """Runs ``bench_decode`` and writes ``decode.json`` (``record``, i.e. device, torch and
    library versions and settings, plus the run's), ``decode.md`` and ``decode.png`` under
    ``out``; returns (the JSON's dict, the markdown text)."""
    device_name = torch.cuda.get_device_name() if opts.on_cuda else "CPU"
    note(f"bench: decode on {device_name}")
    result = dict(record, device=device_name, **bench_decode(opts))
    text = [title("decode", device_name, torch.__version__, record.get("settings") or {}), "",
            f"{result['dtype']}, SwiGLU, uniform routing; read bandwidth measured {result['measured_tbps']:.3f} TB/s "
            f"(buf.sum() over {opts.buffer_bytes / 2**20:.0f} MB), nominal {opts.nominal_tbps} TB/s; median "
            f"us per layer call of {opts.repeats} runs of {opts.calls} calls round the draws"
            + (f"; CUDA-graph peers replay {opts.layers_per_graph} layers a graph" if opts.on_cuda else "")
            + ("; the fp8 peers run on e4m3 weights (128 x 128 blocks, quantized once) against a floor of their "
               "own bytes" if any(_is_fp8(r["peer"]) for r in result["rows"]) else ""), "",
            decode_table(result["rows"])]
    out = Path(out)
    (out / "decode.json").write_text(json.dumps(result, indent=1, default=repr))
    (out / "decode.md").write_text("\n".join(text) + "\n")
    if result["rows"] and not plot_decode(result["rows"], out / "decode.png"):
        note("bench: decode.png not written (matplotlib is not importable)")
    return result, text

