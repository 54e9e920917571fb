"""A training step of the example's HuggingFace MoE model, per experts backend: where it
spends its time (host and device ms per step, torch.profiler tables by device and by
host time, with ``--trace`` a Chrome trace per backend), or, with ``--rounds``, its
tokens/s with the backends alternating in one process.

    python scripts/profile_model.py [--size 100m] [--impl moeblaze grouped_mm] [--compile [MODE]]
        [--steps 5] [--rows 25] [--trace DIR]
    python scripts/profile_model.py --rounds 6 --round-steps 20 [--compile [MODE]]
    python scripts/profile_model.py --rounds 6 --impl moeblaze moeblaze@lean_graph_calls=False grouped_mm

A backend named ``IMPL@NAME=VALUE[,NAME=VALUE...]`` is backend IMPL built, compiled and
run with those kernel settings changed (``moeblaze_ops.settings``): A/B of a setting in
one process.

The model and optimizer are the example's (examples/finetune_hf_moe.py). The profiled
step leaves out the example's per-step loss read, which waits for the GPU; the timed
rounds keep it, so their tokens/s are the example's. Every backend is built, compiled and
warmed up first; then each round times ``--round-steps`` steps of each backend, the
order turning by one backend each round, so that a host whose speed drifts (this one
moves by 20-40% between runs) weighs on every backend alike.
"""

import argparse
import contextlib
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from moeblaze_ops import settings
from moeblaze_ops.bench.cli import parse_setting
from moeblaze_ops.hf import model_config


def _example():
    path = Path(__file__).resolve().parent.parent / "examples" / "finetune_hf_moe.py"
    spec = importlib.util.spec_from_file_location("finetune_hf_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    example = _example()
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="100m", choices=sorted(example.SIZES))
    p.add_argument("--impl", nargs="+", default=["moeblaze", "grouped_mm"],
                   help="experts backends; IMPL@NAME=VALUE,... runs IMPL with kernel settings changed")
    p.add_argument("--compile", nargs="?", const="default", choices=example.COMPILE_MODES)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--trace", default=None, help="a folder to write Chrome traces into")
    p.add_argument("--rounds", type=int, default=0, help="time this many alternating rounds instead of profiling")
    p.add_argument("--round-steps", type=int, default=20, help="steps of each backend in a round")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    config = model_config("qwen3_moe", max_positions=512, **example.SIZES[a.size])
    state = AutoModelForCausalLM.from_config(config, dtype=dtype).state_dict()
    ids = torch.randint(0, config.vocab_size, (a.batch, a.seq), device=a.device)
    if a.rounds:
        return alternate(a, {impl: training_step(a, example, impl, config, state, dtype, ids) for impl in a.impl}, ids)
    for impl in a.impl:
        torch._dynamo.reset()
        step = training_step(a, example, impl, config, state, dtype, ids)
        profile_step(a, impl, step)
        del step
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()


def backend(name):
    """(experts implementation, kernel settings changes) of a backend named ``IMPL`` or
    ``IMPL@NAME=VALUE,...``."""
    impl, _, changes = name.partition("@")
    return impl, dict(parse_setting(item) for item in changes.split(",") if item)


def training_step(a, example, name, config, state, dtype, ids):
    """The example's training step for backend ``name`` (model built, compiled and warmed up,
    under the backend's settings): a function of ``read_loss``, which reads the loss to the
    host as the example does."""
    impl, changes = backend(name)

    def in_settings():
        return settings.override(**changes) if changes else contextlib.nullcontext()

    with in_settings():
        run, opt = example.build_model(config, state, impl, device=a.device, dtype=dtype, compile_mode=a.compile,
                                       lr=1e-3)

    def step(read_loss=False):
        with in_settings():
            loss = example.train_step(run, opt, ids, a.compile)
        if read_loss:
            float(loss.detach())

    for _ in range(5):
        step()
    _sync(a.device)
    return step


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def alternate(a, steps, ids):
    """Prints each backend's tokens/s per round and their medians, the order of the
    backends turning each round."""
    names = list(steps)
    rates = {name: [] for name in names}
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(a.round_steps):
                steps[name](read_loss=True)
            _sync(a.device)
            rates[name].append(ids.numel() * a.round_steps / (time.perf_counter() - t0))
        print(f"round {r}: " + ", ".join(f"{name} {rates[name][-1]:,.0f}" for name in names), flush=True)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    last = names[-1]
    for name in names:
        print(f"{name}: median {medians[name]:,.0f} tokens/s (min {min(rates[name]):,.0f}, max "
              f"{max(rates[name]):,.0f}), {medians[name] / medians[last]:.2f}x {last}")


def profile_step(a, impl, step):
    """Prints host, wall and device ms per step and the profiler's tables; writes a trace."""
    cuda = a.device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        host = (time.perf_counter() - t0) / a.steps * 1e3
        _sync(a.device)
        wall = (time.perf_counter() - t0) / a.steps * 1e3
    events = prof.key_averages()
    device = sum(e.self_device_time_total for e in events
                 if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / a.steps / 1e3
    print(f"\n## {impl}{' compiled ' + a.compile if a.compile else ''}: host ms per step {host:.2f}, "
          f"wall {wall:.2f}, device {device:.2f}", flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=a.rows), flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows), flush=True)
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(a.trace, f"{a.size}-{impl}-{a.compile or 'eager'}.json"))


if __name__ == "__main__":
    main()
