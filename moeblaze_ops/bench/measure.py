"""The measurements: time, peak memory and activation memory of each peer, per config,
and the dispatch micro-benchmark.

On CUDA a time is ``triton.testing.do_bench``'s median and a peak the most memory one call
allocates above what was allocated before it. On CPU (the benchmark's smoke check) a time
is the mean of three ``perf_counter`` calls and a peak is NaN: the allocator keeps no
statistics there. With a settle time (``BenchContext.settle_s``, ``--settle``) each timing
follows that many seconds of the same calls back to back.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .configs import CONFIGS, DISPATCH_CASES, load_imbalance, make_inputs, make_variant, variant_dtype
from .console import emit, note, progress
from .implementations import CUDA_GRAPH_PEERS, INFERENCE_PEERS, peers, train_step

NAN = float("nan")

__all__ = ["BenchContext", "settle", "time_ms", "peak_bytes", "activation_bytes", "bench_forward", "bench_train",
           "bench_dispatch"]


@dataclass(frozen=True)
class BenchContext:
    """Where the benchmark runs, which peers it leaves out, whether it adds the peers that
    replay CUDA graphs (``CUDA_GRAPH_PEERS``: time only), the routing's imbalance (its
    ``tilt``, ``hot`` expert 0 and ``empty`` last experts, as ``make_inputs`` takes them;
    all 0 is uniform), the token counts each config runs at (None: the config's own T;
    else one row per token count, the config's d, I, E, K kept) and the layer variant
    measured (``configs.VARIANTS``: ``none``, the plain SwiGLU layer; ``bias``; ``clamped``;
    ``fp16``). ``settle_s``: the seconds each timing (``time_ms``) first steps its peer back
    to back, so that it runs at the clocks a training loop settles at (the GPU's power
    limit), not the higher ones of a cool GPU; 0 times after ``do_bench``'s warm-up alone."""

    device: str = "cuda"
    skip: frozenset = frozenset()
    cuda_graphs: bool = False
    tilt: float = 0.0
    hot: float = 0.0
    empty: int = 0
    tokens: tuple | None = None
    variant: str = "none"
    settle_s: float = 0.0

    @property
    def on_cuda(self) -> bool:
        """Whether the measurements use CUDA's timer and allocator statistics."""
        return self.device == "cuda"


def settle(call, device, settle_s):
    """Calls ``call()`` back to back until ``settle_s`` seconds of wall time have passed (a
    call or so more). On CUDA the calls go in batches that double in size (1, 2, 4, ...),
    the last cut to the time left, with a sync after each batch alone: a sync after every
    call would leave the GPU idle between small steps, below the power limit it is to reach."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    calls, batch = 0, 1
    t0 = time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < settle_s:
        if calls:  # the calls so far give the time of one: no batch runs far past settle_s
            batch = min(2 * batch, math.ceil((settle_s - elapsed) * calls / max(elapsed, 1e-9)))
        for _ in range(batch):
            call()
        sync()
        calls += batch


def time_ms(fn, device, reps_ms=200, grad_to_none=(), settle_s=0.0):
    """Milliseconds one call of ``fn`` takes on ``device``; the ``.grad`` of each tensor in
    ``grad_to_none`` is set to None before each call (a training step after
    ``zero_grad(set_to_none=True)``: the backward makes the gradients, adds nothing), out
    of the timed span on CUDA. With ``settle_s`` > 0 the timing follows ``settle_s``
    seconds of calls back to back (``settle``): do_bench's 50 ms warm-up and 200 ms of
    reps of a training step run mostly before the GPU's clocks settle at its power limit."""
    def call():
        for t in grad_to_none:
            t.grad = None
        return fn()

    if settle_s > 0:
        settle(call, device, settle_s)
    if device != "cuda":
        call()
        t0 = time.perf_counter()
        for _ in range(3):
            call()
        return (time.perf_counter() - t0) / 3 * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=reps_ms, grad_to_none=list(grad_to_none) or None,
                                   return_mode="median")


def peak_bytes(fn, device):
    """Peak memory one call of ``fn`` adds above what is allocated before it (CUDA; NaN elsewhere)."""
    if device != "cuda":
        fn()
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def activation_bytes(fn, exclude):
    """Runs ``fn()`` and returns (its output, the bytes of the unique storages autograd saved
    for backward, those of ``exclude`` (parameters, the layer input) left out)."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved.values())


def _runnable(ctx, fns, first_call):
    """(peer, fn, ``first_call(fn)``) for each peer not skipped; the first call warms up
    (compiles) the peer. On CPU a peer whose first call fails is left out with a one-line
    note, so the smoke check still measures the others; on CUDA the error stops the run."""
    for peer, fn in fns.items():
        if peer in ctx.skip:
            continue
        try:
            first = first_call(fn)
        except Exception as e:
            if ctx.on_cuda:
                raise
            reason = (str(e).strip().splitlines() or [""])[0]
            note(f"bench: {peer} left out on {ctx.device}: {type(e).__name__}: {reason}")
            continue
        yield peer, fn, first


def _no_grad_call(fn):
    with torch.no_grad():
        return fn()


def _release_cached(ctx):
    if ctx.on_cuda:
        torch.cuda.empty_cache()


def _cases(ctx, names):
    """(config, T, d, I, E, K) of each config at each of ``ctx.tokens`` (its own T if none)."""
    cases = []
    for name in names:
        T, d, I, E, K = CONFIGS[name]
        cases += [(name, t, d, I, E, K) for t in (ctx.tokens or (T,))]
    return cases


def _layer(ctx, T, d, I, E, K):
    """(the inputs ``make_inputs`` draws for the case, in the variant's dtype, with the
    routing's tilt, hot and empty; the variant's further ``moe_experts`` arguments,
    ``make_variant``'s; the tensors among those, the biases, trained as the weights are)."""
    inputs = make_inputs(T, d, I, E, K, dtype=variant_dtype(ctx.variant), device=ctx.device, tilt=ctx.tilt,
                         hot=ctx.hot, empty=ctx.empty)
    layer = make_variant(ctx.variant, inputs[3], inputs[4])
    return inputs, layer, [t for t in layer.values() if isinstance(t, torch.Tensor)]


def _peers(ctx, inputs, layer, **kwargs):
    """``peers`` of ``inputs``, given the variant's arguments ``layer`` where there are any
    (the plain layer's call is the one it always was)."""
    if layer:
        kwargs["variant"] = layer
    return peers(*inputs, cuda_graphs=ctx.cuda_graphs, **kwargs)


def _row(ctx, case, imbalance, peer, ms, flops, **measured):
    """One measured row: the case (config, T, the routing's tilt, hot and empty, and its
    max/mean expert load, ``imbalance`` read here, after the peer's timing), the layer
    variant, the peer, its time (per call and per token, to compare token counts) and
    TFLOP/s, then ``measured``."""
    name, T = case[:2]
    return emit(dict(config=name, T=T, tilt=ctx.tilt, hot=ctx.hot, empty=ctx.empty, variant=ctx.variant,
                     load_imbalance=float(imbalance), peer=peer, ms=ms, us_per_token=ms * 1e3 / T,
                     tflops=flops / ms / 1e9, **measured))


def bench_forward(ctx, names):
    """Rows of the forward benchmark: per config (at each token count) and peer, its time,
    TFLOP/s, peak memory without grad and in a training forward, and its output's difference
    from the first peer's."""
    rows = []
    for case in progress(_cases(ctx, names), "forward"):
        _, T, d, I, E, K = case
        torch._dynamo.reset()  # each case compiles its peers afresh: no recompile limit across cases
        inputs, layer, biases = _layer(ctx, T, d, I, E, K)
        imbalance = load_imbalance(inputs[1], E)  # queued on the device; read after timing (_row)
        flops = 6 * T * K * d * I  # forward: 2*LK*d*2I + 2*LK*I*d (the GEMMs; biases and activation not counted)
        fns = _peers(ctx, inputs, layer)
        ref = None
        for peer, fn, out in _runnable(ctx, fns, _no_grad_call):
            with torch.no_grad():
                if ref is None:
                    ref = out.float()
                err = float((out.float() - ref).norm() / ref.norm())
                ms = time_ms(fn, ctx.device, settle_s=ctx.settle_s)
            if peer in CUDA_GRAPH_PEERS:
                rows.append(_row(ctx, case, imbalance, peer, ms, flops, peak_gb=NAN, train_fwd_peak_gb=NAN,
                                 rel_diff_vs_first=err))
                continue
            with torch.no_grad():
                mem = peak_bytes(fn, ctx.device)
            if peer in INFERENCE_PEERS:  # no backward: no training forward to measure
                rows.append(_row(ctx, case, imbalance, peer, ms, flops, peak_gb=mem / 1e9, train_fwd_peak_gb=NAN,
                                 rel_diff_vs_first=err))
                continue
            # A training forward: the weights require grad, so each peer also keeps what its
            # backward needs. Measured once, after a warm-up (compile) call.
            trainable = [inputs[i] for i in (0, 2, 3, 4)] + biases  # x, topk_weights, w_gate_up, w_down, biases
            for t in trainable:
                t.requires_grad_(True)
            fn()
            train_mem = peak_bytes(fn, ctx.device)
            for t in trainable:
                t.requires_grad_(False)
            rows.append(_row(ctx, case, imbalance, peer, ms, flops, peak_gb=mem / 1e9,
                             train_fwd_peak_gb=train_mem / 1e9, rel_diff_vs_first=err))
        del fns, inputs, layer, biases, ref, imbalance
        _release_cached(ctx)
    return rows


def bench_train(ctx, names):
    """Rows of the train benchmark: per config (at each token count) and peer, the time and
    TFLOP/s of forward + backward, the peak memory of one step from no gradients and of one
    that adds into the gradients of the step before (gradient accumulation), and the
    activation memory kept for backward."""
    rows = []
    for case in progress(_cases(ctx, names), "train"):
        _, T, d, I, E, K = case
        torch._dynamo.reset()
        inputs, layer, biases = _layer(ctx, T, d, I, E, K)
        x, ids, w, w_gate_up, w_down = inputs
        imbalance = load_imbalance(ids, E)  # queued on the device; read after timing (_row)
        trained = (x, w, w_gate_up, w_down, *biases)  # the tensors backward makes gradients of
        for t in trained:
            t.requires_grad_(True)
        # The GEMMs alone (biases and activation not counted): the backward's (dX and dW of each)
        # are twice the forward's 6*T*K*d*I.
        flops = 18 * T * K * d * I
        grad = torch.randn(T, d, device=ctx.device, dtype=x.dtype,
                           generator=torch.Generator(ctx.device).manual_seed(1))

        def step(fn):
            train_step(fn, grad)

        def fresh_step(fn):
            # A replayed graph's gradients are its outputs, overwritten by the next replay, so
            # every step (do_bench's warm-up ones too) starts from none, as a training loop
            # does after zero_grad(set_to_none=True).
            for t in trained:
                t.grad = None
            step(fn)

        for peer, fn, _ in _runnable(ctx, _peers(ctx, inputs, layer, train=True), fresh_step):
            # The CUDA-graph peers clear their gradients inside the step too (fresh_step);
            # time_ms clears them for every peer's timed steps.
            timed = fresh_step if peer in CUDA_GRAPH_PEERS else step
            ms = time_ms(lambda fn=fn, timed=timed: timed(fn), ctx.device, grad_to_none=trained,
                         settle_s=ctx.settle_s)
            if peer in CUDA_GRAPH_PEERS:
                rows.append(_row(ctx, case, imbalance, peer, ms, flops, peak_gb=NAN, accumulate_peak_gb=NAN,
                                 activation_gb=NAN, activation_bytes=NAN))
                continue
            # From no gradients, as a training step starts after zero_grad(set_to_none=True):
            # the gradients' allocation counts, whichever peer ran before.
            for t in trained:
                t.grad = None
            mem = peak_bytes(lambda fn=fn: step(fn), ctx.device)
            # Under gradient accumulation: the next step adds into the gradients this one left.
            accumulate_mem = peak_bytes(lambda fn=fn: step(fn), ctx.device)
            out, act = activation_bytes(fn, exclude=[x, w_gate_up, w_down, *biases])
            del out
            for t in trained:
                t.grad = None
            rows.append(_row(ctx, case, imbalance, peer, ms, flops, peak_gb=mem / 1e9,
                             accumulate_peak_gb=accumulate_mem / 1e9, activation_gb=act / 1e9, activation_bytes=act))
        del inputs, layer, biases, trained, x, w, w_gate_up, w_down, imbalance
        _release_cached(ctx)
    return rows


def graph_time_ms(fn, reps_ms=200):
    """Milliseconds one call of ``fn`` takes replayed from a CUDA graph: the device's time,
    without the host's launch path (``triton.testing.do_bench_cudagraph``)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=reps_ms, return_mode="median")


def sort_histc_cumsum(ids, E):
    """The dispatch HF's ``grouped_mm`` runs: a sort of the flat ids, a histogram of them,
    and the counts' cumulative sum (the benchmark's dispatch baseline)."""
    sorted_ids, perm = torch.sort(ids.reshape(-1))
    counts = torch.histc(sorted_ids.int(), bins=E, min=0, max=E - 1)
    return perm, torch.cumsum(counts, 0, dtype=torch.int32)


def bench_dispatch(ctx):
    """Rows of the dispatch micro-benchmark (CUDA): the sort + histc + cumsum that HF's
    ``grouped_mm`` runs, against moeblaze's dispatch kernels alone and its op (with id
    checks). At small sizes each call is bound by its launches on the host; with
    ``ctx.cuda_graphs`` the rows also time each replayed from a CUDA graph (device time)."""
    from moeblaze_ops.kernels.triton_backend import dispatch as triton_dispatch

    rows = []
    for L, K, E in progress(DISPATCH_CASES, "dispatch"):
        ids = torch.randn(L, E, device=ctx.device).topk(K, dim=-1).indices
        fns = dict(sort_histc_cumsum=lambda: sort_histc_cumsum(ids, E),
                   moeblaze_kernels=lambda: triton_dispatch.dispatch(ids, E),
                   moeblaze_op=lambda: torch.ops.moeblaze.dispatch(ids, E))
        row = dict(L=L, K=K, E=E, **{f"{name}_ms": time_ms(fn, ctx.device, settle_s=ctx.settle_s)
                                     for name, fn in fns.items()})
        if ctx.cuda_graphs:
            for name, fn in fns.items():
                try:
                    row[f"{name}_graph_ms"] = graph_time_ms(fn)
                except Exception as e:  # noqa: BLE001 - a call that cannot be captured: its column says nan
                    reason = (str(e).splitlines() or [""])[0]
                    note(f"bench: {name} not timed from a CUDA graph: {type(e).__name__}: {reason}")
                    row[f"{name}_graph_ms"] = float("nan")
        for suffix in ("_ms", "_graph_ms") if ctx.cuda_graphs else ("_ms",):
            base = row[f"sort_histc_cumsum{suffix}"]
            row[f"speedup_kernels{suffix[:-3]}"] = base / row[f"moeblaze_kernels{suffix}"]
            row[f"speedup_op{suffix[:-3]}"] = base / row[f"moeblaze_op{suffix}"]
        rows.append(row)
    return rows
