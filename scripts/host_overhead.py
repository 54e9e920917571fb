"""Where the host time of a small forward + backward goes: wall time per step, then the
Python functions by own time (or ``--sort cumulative``) under cProfile.

    python scripts/host_overhead.py [--config qwen3_100m] [--steps 200] [--rows 30]
    python scripts/host_overhead.py --no-kernels --device cpu --config tiny
    python scripts/host_overhead.py --compile   # the layer under torch.compile (fullgraph)
    python scripts/host_overhead.py --rounds 5  # eager, compiled two ways, CUDA graphs, alternating
    python scripts/host_overhead.py --op-calls  # each op through torch.ops against its kernel alone
    python scripts/host_overhead.py --launches  # one Triton launch through the JIT and around it
    python scripts/host_overhead.py --attribute # the step's host time per kernel launch, JIT and launcher
    python scripts/host_overhead.py --stub-launches --device cpu --config qwen3_100m_b512 [--op-calls]
    python scripts/host_overhead.py --op-registration  # what a call costs by each way of registering an op

Small layers are launch-bound: the device finishes each kernel before the host has
launched the next, so every microsecond here is a microsecond of the step.

``--stub-launches`` (CPU tensors) runs the Triton backend's Python with every kernel
launch and device assert replaced by nothing: the layer's and the ops' host code alone,
on a machine without a GPU. ``--no-kernels`` replaces every kernel of the chosen backend by one that returns the
outputs its first call computed: what is left is moeblaze's own Python (checks, autograd
nodes, op dispatch), measurable on any machine.
"""

import argparse
import functools
import cProfile
import dataclasses
import pstats
import time

import torch

import moeblaze_ops
from moeblaze_ops import kernels
from moeblaze_ops import settings
from moeblaze_ops.bench import CONFIGS, make_inputs
from moeblaze_ops.bench.cli import parse_setting

KERNEL_FIELDS = ("dispatch", "expert_up", "expert_up_activated", "expert_down", "expert_down_activated",
                 "expert_up_backward", "expert_down_backward")


def without_kernels(backend):
    """``backend`` whose kernels replay their first call's outputs and whose index checks
    do nothing."""
    def replay(fn):
        first = []

        def call(*args, **kwargs):
            if not first:
                first.append(fn(*args, **kwargs))
            return first[0]
        return call

    return dataclasses.replace(backend, **{f: replay(getattr(backend, f)) for f in KERNEL_FIELDS},
                               check_index_values=lambda *a: None, check_backward_index_values=lambda *a: None)


def us_per_call(fn, n, warmup=10, sync=torch.cuda.synchronize):
    """Host microseconds per call of ``fn`` over ``n`` calls, after ``warmup`` calls, the
    queued GPU work included up to the last call's end."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def op_calls(x, ids, w, wgu, wd, n):
    """Prints the host microseconds per call of each op (under ``no_grad``, as the autograd
    engine runs backward ops and a compiled graph runs dispatch's result-only use) and of
    its backend function. With grad mode on, ``torch.library.custom_op``'s autograd
    wrapper adds tens of microseconds per call even when no input requires grad."""
    backend = kernels.backward_backend(x)
    eti, offsets, tim = torch.ops.moeblaze.dispatch(ids, wgu.shape[0])
    h = torch.ops.moeblaze.expert_up(x, wgu, eti, offsets, tim)
    grad_out, grad_h = torch.randn_like(x), torch.randn_like(h)
    down_args = (grad_out, h.clone(), wd, eti, offsets, tim, w, None, "swiglu", False, False, 1.702, 7.0)
    up_args = (grad_h, x, wgu, eti, offsets, tim, False, False)
    E = wgu.shape[0]
    # name: (the public op and its internal twin, which compiled graphs call under
    # settings.lean_graph_calls (ops.graph_calls), both on these arguments; the backend's own call)
    ops = {
        "dispatch": (("dispatch",), (ids, E), lambda: backend.dispatch(ids, E)),
        "expert_up": (("expert_up", "_up_kernels"), (x, wgu, eti, offsets, tim),
                      lambda: backend.expert_up(x, wgu, eti, offsets, tim, None, False)),
        "expert_down": (("expert_down", "_down_kernels"), down_args[1:], lambda: backend.expert_down(*down_args[1:])),
        "expert_up_backward": (("expert_up_backward", "_up_backward_kernels"), up_args,
                               lambda: backend.expert_up_backward(*up_args, True, True)),
        "expert_down_backward": (("expert_down_backward",), down_args,
                                 lambda: backend.expert_down_backward(*down_args)),
        "expert_down_backward_ (in place)": (("expert_down_backward_", "_down_backward_kernels_"), down_args,
                                             lambda: backend.expert_down_backward(*down_args, in_place=True)),
    }
    calls = {op: (functools.partial(getattr(torch.ops.moeblaze, op), *args), kernels_alone)
             for names, args, kernels_alone in ops.values() for op in names}
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    torch.set_grad_enabled(False)
    for name, pair in calls.items():
        times = [us_per_call(fn, n, sync=sync) for fn in pair]
        print(f"{name}: {times[0]:.1f} us per call through torch.ops, {times[1]:.1f} us its kernels alone")


def launch_costs(n):
    """Prints the host microseconds of one launch of a small Triton kernel (the combine, 13
    arguments) through the JIT (``kernel[grid](...)``: argument binding, cache lookup,
    launcher), through the compiled kernel's own runner, and through its launcher alone;
    what one TMA descriptor of a weight costs to make on the host; then one weight gradient
    of the 100M example's layer at its batch by each Gluon kernel form and by tl."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moeblaze_ops.kernels import triton_combine as tc

    L, K, d, E = 512, 4, 512, 32
    rows = torch.randn(L * K, d, device="cuda", dtype=torch.bfloat16)
    tim = torch.randperm(L * K, device="cuda", dtype=torch.int32)
    weights = torch.rand(L, K, device="cuda")
    offsets = torch.tensor([0] * E + [L * K], device="cuda", dtype=torch.int32)
    out = torch.empty(L, d, device="cuda", dtype=torch.bfloat16)
    grid = (triton.cdiv(L, tc.COMBINE_TILE[0]), triton.cdiv(d, tc.COMBINE_TILE[1]))
    args = (rows, tim, weights, offsets, out, L, d, E, rows.stride(0), weights.stride(0), weights.stride(1),
            out.stride(0))
    meta = dict(K=K, BLOCK_L=tc.COMBINE_TILE[0], BLOCK_D=tc.COMBINE_TILE[1], WEIGHTED=True)
    compiled = tc._combine_kernel[grid](*args, **meta)
    stream = torch.cuda.current_stream().cuda_stream
    grid = (*grid, 1)
    runner = compiled[grid]
    all_args = (*args, *meta.values())  # the launcher takes constexprs in their places and skips them

    def direct():
        compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *all_args)

    w = torch.randn(32, 1024, 512, device="cuda", dtype=torch.bfloat16)
    # A weight gradient of the 100M example's layer at its batch (64 rows per expert), by
    # the Gluon kernel in each form and by the tl one.
    from moeblaze_ops import settings
    from moeblaze_ops.kernels import triton_experts_backward as tb
    E, P, Q = 32, 512, 512
    wg_rows = torch.randn(E * 64, P, device="cuda", dtype=torch.bfloat16)
    wg_gathered = torch.randn(L, Q, device="cuda", dtype=torch.bfloat16)
    wg_ids = torch.randint(0, L, (E * 64,), device="cuda", dtype=torch.int32)
    wg_offsets = torch.arange(E + 1, device="cuda", dtype=torch.int32) * 64
    wg_out = torch.empty(E, Q, P, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    def wgrad():
        tb.launch_wgrad(wg_rows, wg_gathered, wg_ids, wg_offsets, wg_out, kind="wgrad_up")

    def override_alone():
        with settings.override(wgrad_tma_store=True):
            pass

    # (name, call, the settings in force around the timing loop, not inside the call)
    calls = [
        ("JIT launch (kernel[grid](...))", lambda: tc._combine_kernel[grid](*args, **meta), {}),
        ("compiled kernel's runner", lambda: runner(*all_args, stream=stream), {}),
        ("launcher alone", direct, {}),
        ("one weight TMA descriptor (TensorDescriptor.from_tensor)",
         lambda: TensorDescriptor.from_tensor(w.view(-1, 512), [64, 128]), {}),
        ("settings.override, entered and left", override_alone, {}),
        ("weight gradient, Gluon, rows by TMA, tiles by TMA", wgrad, dict(wgrad_rows_tma={"wgrad_up"})),
        ("weight gradient, Gluon, rows by TMA, tiles from registers", wgrad,
         dict(wgrad_rows_tma={"wgrad_up"}, wgrad_tma_store=False)),
        ("weight gradient, Gluon, cp.async rows", wgrad, dict(wgrad_rows_tma=(), wgrad_tma_store=False)),
        ("weight gradient, tl", wgrad, dict(gluon=())),
    ]
    for name, fn, changes in calls:
        with settings.override(small_gemm_flop=0, **changes):
            print(f"{name}: {us_per_call(fn, n, warmup=20):.1f} us")


def op_registration_costs(n):
    """Prints the host microseconds of one call of a do-nothing op with the down backward's
    14 arguments, registered through ``torch.library.custom_op`` and through the low-level
    ``torch.library.Library`` API, mutating one argument or none (what an op the compiled
    graph keeps opaque pays for its registration alone)."""
    lib = torch.library.Library("moeblaze_probe", "DEF")
    params = ("Tensor a, Tensor{m} h, Tensor w, Tensor e, Tensor o, Tensor t, Tensor tw, Tensor? b, str act, "
              "bool tr, bool il, float al, float li, bool nw=True")

    def body(a, h, w, e, o, t, tw, b, act, tr, il, al, li, nw=True):
        return a.new_empty(0), a.new_empty(0), a.new_empty(0)

    calls = {}
    for mutates, suffix in ((False, ""), (True, "_")):
        low = f"low{suffix}"
        lib.define(f"{low}({params.format(m='(a!)' if mutates else '')}) -> (Tensor, Tensor, Tensor)")
        lib.impl(low, body, "CompositeExplicitAutograd")
        high = torch.library.custom_op(f"moeblaze_probe::high{suffix}", mutates_args=("h",) if mutates else (),
                                       schema=f"({params.format(m='(a!)' if mutates else '')}) -> "
                                              "(Tensor, Tensor, Tensor)")(body)
        kind = "mutating h" if mutates else "functional"
        calls[f"custom_op, {kind}"] = high
        calls[f"Library.define + impl, {kind}"] = getattr(torch.ops.moeblaze_probe, low)
    x = torch.zeros(4)
    args = (x, x.clone(), x, x, x, x, x, None, "swiglu", False, False, 1.0, 2.0, True)
    calls["the body alone"] = body
    with torch.no_grad():
        for name, fn in calls.items():
            print(f"{name}: {us_per_call(lambda: fn(*args), n, sync=lambda: None):.1f} us")


def stub_launches():
    """Every Triton launch and device assert of the Triton backend does nothing."""
    from moeblaze_ops.kernels import grouped_gemm, triton_combine, triton_dispatch, triton_experts
    from moeblaze_ops.kernels import triton_experts_backward

    for module in (grouped_gemm, triton_combine, triton_dispatch, triton_experts, triton_experts_backward):
        module.launch = lambda *args, **kwargs: None
    torch._assert_async = lambda *args, **kwargs: None


def attribute(step, n):
    """Prints, per Triton kernel the step launches, the host microseconds of its launches
    through the JIT (``JITFunction.run``: argument binding, cache lookup, launcher) and of
    the launcher alone, per step, beside the step's wall time: what is left is Python
    around the launches (moeblaze's, autograd's, torch's)."""
    from collections import defaultdict

    from triton.runtime.jit import JITFunction

    from moeblaze_ops.kernels import launch as launch_plans

    jit_us, launcher_us, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    plain_run, wrapped = JITFunction.run, set()

    def timed_launcher(name, run):
        def launch(*args, **kwargs):
            t0 = time.perf_counter()
            out = run(*args, **kwargs)
            launcher_us[name] += (time.perf_counter() - t0) * 1e6
            return out
        return launch

    def timed_run(self, *args, **kwargs):
        name = self.fn.__name__
        t0 = time.perf_counter()
        kernel = plain_run(self, *args, **kwargs)
        jit_us[name] += (time.perf_counter() - t0) * 1e6
        calls[name] += 1
        if id(kernel) not in wrapped:  # the compiled kernel's launcher, timed from its next call
            wrapped.add(id(kernel))
            kernel._run = timed_launcher(name, kernel.run)  # ``run`` is a property over ``_run`` (triton 3.6)
        return kernel

    wall = us_per_call(step, n, warmup=5)
    JITFunction.run = timed_run
    try:
        for _ in range(5):
            step()
        for sig in launch_plans._signatures.values():  # launches through plans reach only their launchers
            for compiled in (sig.plans.values() if sig is not None else ()):
                if id(compiled) not in wrapped:
                    wrapped.add(id(compiled))
                    compiled._run = timed_launcher(compiled.name, compiled.run)
        for d in (jit_us, launcher_us, calls):
            d.clear()
        timed_wall = us_per_call(step, n, warmup=0)
    finally:
        JITFunction.run = plain_run
    print(f"step wall {wall:.1f} us ({timed_wall:.1f} timed); per step, host us in each kernel's launches "
          "through the JIT, and in its launcher (a launch plan's launches reach the launcher alone):")
    total = launchers = 0.0
    for name in sorted(set(jit_us) | set(launcher_us), key=lambda k: jit_us.get(k, 0) + launcher_us[k], reverse=True):
        total, launchers = total + jit_us[name] / n, launchers + launcher_us[name] / n
        print(f"  {name}: {jit_us[name] / n:.1f}, {launcher_us[name] / n:.1f} ({calls[name] / n:.0f} calls "
              "through the JIT)")
    print(f"  all launches: {total:.1f} us, {launchers:.1f} in launchers")


def harness_rounds(x, ids, w, wgu, wd, g, rounds, steps, sync):
    """Microseconds per forward + backward (gradients cleared each step, as after
    ``zero_grad``) of the layer by each harness, in ``rounds`` alternating rounds of
    ``steps`` steps, then the medians: eager; compiled with the weights as arguments (the
    ``--compile`` run above); compiled with them in a closure, as the benchmark's peers
    are; and on CUDA, the benchmark's CUDA-graph peer (``mode="reduce-overhead"``)."""
    from moeblaze_ops.bench import peers

    fns = peers(x, ids, w, wgu, wd, cuda_graphs=x.is_cuda)
    compiled = torch.compile(moeblaze_ops.moe_experts, fullgraph=True)
    harnesses = {"eager": fns["moeblaze"], "compiled, weights as arguments": lambda: compiled(x, ids, w, wgu, wd),
                 "compiled, weights in a closure": fns["moeblaze_compiled"]}
    if x.is_cuda:
        harnesses["CUDA graphs"] = fns["moeblaze_cudagraphs"]

    def step(fn):
        for t in (x, w, wgu, wd):
            t.grad = None
        fn().backward(g)

    times = {name: [] for name in harnesses}
    for _ in range(10):
        for fn in harnesses.values():
            step(fn)
    for r in range(rounds):
        for name, fn in harnesses.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(fn)
            sync()
            times[name].append((time.perf_counter() - t0) / steps * 1e6)
            print(f"round {r}: {name}: {times[name][-1]:.1f} us per forward + backward", flush=True)
    for name, ts in times.items():
        print(f"median of {rounds}: {name}: {sorted(ts)[len(ts) // 2]:.1f} us")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="qwen3_100m", choices=[*CONFIGS, "tiny"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"],
                   help="the cProfile table's order: own time, or time with callees")
    p.add_argument("--no-kernels", action="store_true", help="time moeblaze's Python alone (see above)")
    p.add_argument("--compile", action="store_true", help="the layer compiled (torch.compile, fullgraph)")
    p.add_argument("--op-calls", action="store_true",
                   help="host time of one call of each op through torch.ops.moeblaze, then of its backend "
                        "function alone (what a compiled graph's extern call costs beyond the kernels)")
    p.add_argument("--op-registration", action="store_true",
                   help="host time of one call of an op by each way of registering it (any machine)")
    p.add_argument("--stub-launches", action="store_true",
                   help="CPU tensors through the Triton backend's Python, every launch a no-op (see above)")
    p.add_argument("--attribute", action="store_true",
                   help="the step's host time in each kernel's Triton launches (CUDA)")
    p.add_argument("--set", dest="settings", metavar="NAME=VALUE", action="append", type=parse_setting, default=[],
                   help="change a kernel setting for the run (repeatable)")
    p.add_argument("--launches", action="store_true",
                   help="host time of one Triton launch, through the JIT and around it (CUDA)")
    p.add_argument("--rounds", type=int, default=0,
                   help="this many rounds of the layer eager, compiled with its weights as arguments, compiled "
                        "with them in a closure (the benchmark's peers), and with CUDA graphs (CUDA), alternating")
    a = p.parse_args()
    changes = dict(a.settings)
    if a.stub_launches:
        stub_launches()
        changes.setdefault("backend", "triton")
    with settings.override(**changes):
        run(a)


def run(a):
    if a.op_registration:
        return op_registration_costs(max(a.steps, 2000))
    if a.launches:
        return launch_costs(max(a.steps, 1000))
    shape = (64, 32, 16, 8, 2) if a.config == "tiny" else CONFIGS[a.config]
    x, ids, w, wgu, wd = make_inputs(*shape, device=a.device)
    if a.no_kernels:
        kernels.TORCH = without_kernels(kernels.TORCH)
        if x.is_cuda:
            replayed = without_kernels(kernels.triton_backend())
            kernels.triton_backend = lambda: replayed
    if a.op_calls:
        return op_calls(x, ids, w, wgu, wd, a.steps)
    for t in (x, w, wgu, wd):
        t.requires_grad_(True)
    g = torch.randn_like(x)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    if a.rounds:
        return harness_rounds(x, ids, w, wgu, wd, g, a.rounds, a.steps, sync)

    layer = torch.compile(moeblaze_ops.moe_experts, fullgraph=True) if a.compile else moeblaze_ops.moe_experts

    def step():
        for t in (x, w, wgu, wd):  # as after zero_grad(set_to_none=True): no accumulation kernels
            t.grad = None
        layer(x, ids, w, wgu, wd).backward(g)

    def steps(n):
        for _ in range(n):
            step()
        sync()

    if a.attribute:
        return attribute(step, a.steps)
    steps(10)
    t0 = time.perf_counter()
    steps(a.steps)
    kind = ("without kernels" if a.no_kernels else "(wall)") + (", compiled" if a.compile else "")
    per_step = (time.perf_counter() - t0) / a.steps * 1e6
    print(f"{a.config} on {a.device}: {per_step:.1f} us per forward + backward {kind}")
    if a.rows > 0:
        prof = cProfile.Profile()
        prof.runcall(steps, a.steps)
        pstats.Stats(prof).sort_stats(a.sort).print_stats(a.rows)


if __name__ == "__main__":
    main()
