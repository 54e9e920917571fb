"""Kernel settings A/B on moeblaze's forward + backward, interleaved in one process.

    python scripts/ab_step.py --configs olmoe mixtral --variant "" \
        --variant "wgrad_split_mma={'wgrad_up'}" [--variant "a=1 b=2" ...] [--rounds 4] [--device cuda|cpu] \
        [--compiled]

Each ``--variant`` is a space-separated list of ``NAME=VALUE`` (``bench --set``'s syntax;
an empty string is the defaults). Every round times each variant once, in turn, on the
same inputs (the benchmark's ``make_inputs`` and timer), so the GPU's clock and power
drift lands on every variant alike: between processes the spread can exceed a kernel
change's effect (docs/perf-notes.md). Prints each round's milliseconds and, per variant,
the median and its ratio to the first variant's median. With ``--compiled`` the layer's
forward runs under ``torch.compile(fullgraph=True)``, compiled once per variant under its
settings (the graph keeps the settings it was lowered with).
"""

import argparse
import statistics
import types

import torch

from moeblaze_ops import moe_experts, settings
from moeblaze_ops.bench import CONFIGS, make_inputs
from moeblaze_ops.bench.cli import parse_setting
from moeblaze_ops.bench.measure import time_ms


def parse_variant(text):
    """``"a=1 b=2"`` -> ``{"a": 1, "b": 2}`` (``bench --set``'s parsing of each item)."""
    return dict(parse_setting(item) for item in text.split())


def layer_fns(count, compiled):
    """``count`` functions computing ``moe_experts``: compiled ones each with a code object
    of its own (torch.compile caches graphs per code object and does not guard on the
    settings, so a shared one would reuse the first variant's graph)."""
    if not compiled:
        return [moe_experts] * count

    def layer(x, ids, w, w_gate_up, w_down):
        return moe_experts(x, ids, w, w_gate_up, w_down)

    return [torch.compile(types.FunctionType(layer.__code__.replace(co_name=f"layer_{i}"), layer.__globals__),
                          fullgraph=True) for i in range(count)]


def run(configs, variants, rounds, device, compiled=False):
    """{config: {variant index: [ms per round]}} of one training step per variant."""
    results = {}
    for name in configs:
        T, d, I, E, K = CONFIGS[name]
        x, ids, w, w_gate_up, w_down = make_inputs(T, d, I, E, K, device=device)
        params = (x, w, w_gate_up, w_down)
        for t in params:
            t.requires_grad_(True)
        grad = torch.randn_like(x)
        fns = layer_fns(len(variants), compiled)

        def step(i):
            return lambda: fns[i](x, ids, w, w_gate_up, w_down).backward(grad)

        times = results[name] = {i: [] for i in range(len(variants))}
        for _ in range(rounds):
            for i, variant in enumerate(variants):
                with settings.override(**variant):
                    times[i].append(time_ms(step(i), device, grad_to_none=params))
        del x, ids, w, w_gate_up, w_down, grad, params
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def report(results, labels):
    """A markdown table: a row per config and variant, each round's time, the median, its
    ratio to the first variant's."""
    lines = ["| config | variant | ms per round | median | vs first |", "| --- | --- | --- | --- | --- |"]
    for name, times in results.items():
        base = statistics.median(times[0])
        for i, label in enumerate(labels):
            med = statistics.median(times[i])
            rounds = ", ".join(f"{t:.2f}" for t in times[i])
            lines.append(f"| {name} | {label or 'defaults'} | {rounds} | {med:.2f} | {base / med:.3f}x |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["olmoe", "mixtral"], choices=list(CONFIGS))
    p.add_argument("--variant", dest="variants", action="append", default=[],
                   help="space-separated NAME=VALUE settings (repeat for each variant; '' for the defaults)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--compiled", action="store_true", help="the layer's forward under torch.compile")
    a = p.parse_args()
    labels = a.variants or [""]
    try:
        variants = [parse_variant(v) for v in labels]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    print(report(run(a.configs, variants, a.rounds, a.device, a.compiled), labels), flush=True)


if __name__ == "__main__":
    main()
