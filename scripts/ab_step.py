"""Kernel settings A/B on moeblaze's forward + backward, interleaved in one process.

    python scripts/ab_step.py --configs olmoe mixtral --variant "" \
        --variant "wgrad_split_mma={'wgrad_up'}" [--variant "a=1 b=2" ...] [--rounds 4] [--device cuda|cpu] \
        [--compiled] [--mode train|forward]

Each ``--variant`` is a space-separated list of ``NAME=VALUE`` (``bench --set``'s syntax;
an empty string is the defaults). Every round times each variant once, in turn, on the
same inputs (the benchmark's ``make_inputs`` and timer), so the GPU's clock and power
drift lands on every variant alike: between processes the spread can exceed a kernel
change's effect (docs/perf-notes.md). Prints each round's milliseconds and, per variant,
the median and its ratio to the first variant's median. With ``--compiled`` the layer's
forward runs under ``torch.compile(fullgraph=True)``, compiled once per variant under its
settings (the graph keeps the settings it was lowered with). ``--mode forward`` times the
forward alone, without gradients (the benchmark's forward mode). Each variant's peak
memory of one call (above what is allocated before it, ``bench.measure.peak_bytes``) is
measured after the rounds and reported beside its times.
"""

import argparse
import statistics
import types

import torch

from moeblaze_ops import moe_experts, settings
from moeblaze_ops.bench import CONFIGS, make_inputs
from moeblaze_ops.bench.cli import parse_setting
from moeblaze_ops.bench.measure import peak_bytes, time_ms


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


def run(configs, variants, rounds, device, compiled=False, mode="train"):
    """({config: {variant index: [ms per round]}}, {config: {variant index: peak GB}}) of one
    training step (``mode`` "train") or one forward without gradients ("forward") per variant."""
    results, peaks = {}, {}
    train = mode == "train"
    for name in configs:
        T, d, I, E, K = CONFIGS[name]
        x, ids, w, w_gate_up, w_down = make_inputs(T, d, I, E, K, device=device)
        params = (x, w, w_gate_up, w_down)
        for t in params:
            t.requires_grad_(train)
        grad = torch.randn_like(x)
        fns = layer_fns(len(variants), compiled)

        def step(i):
            if train:
                return lambda: fns[i](x, ids, w, w_gate_up, w_down).backward(grad)

            def forward():
                with torch.no_grad():
                    return fns[i](x, ids, w, w_gate_up, w_down)
            return forward

        times = results[name] = {i: [] for i in range(len(variants))}
        for _ in range(rounds):
            for i, variant in enumerate(variants):
                with settings.override(**variant):
                    times[i].append(time_ms(step(i), device, grad_to_none=params if train else ()))
        peaks[name] = {}
        for i, variant in enumerate(variants):
            for t in params:
                t.grad = None
            with settings.override(**variant):
                peaks[name][i] = peak_bytes(step(i), device) / 1e9
        del x, ids, w, w_gate_up, w_down, grad, params
        if device == "cuda":
            torch.cuda.empty_cache()
    return results, peaks


def report(results, peaks, labels):
    """A markdown table: a row per config and variant, each round's time, the median, its
    ratio to the first variant's (speed: above 1 is faster), the peak memory of one call."""
    lines = ["| config | variant | ms per round | median | vs first | peak GB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, times in results.items():
        base = statistics.median(times[0])
        for i, label in enumerate(labels):
            med = statistics.median(times[i])
            rounds = ", ".join(f"{t:.2f}" for t in times[i])
            lines.append(f"| {name} | {label or 'defaults'} | {rounds} | {med:.2f} | {base / med:.3f}x "
                         f"| {peaks[name][i]:.3f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["olmoe", "mixtral"], choices=list(CONFIGS))
    p.add_argument("--variant", dest="variants", action="append", default=[],
                   help="space-separated NAME=VALUE settings (repeat for each variant; '' for the defaults)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--compiled", action="store_true", help="the layer's forward under torch.compile")
    p.add_argument("--mode", default="train", choices=["train", "forward"],
                   help="train: forward + backward; forward: the forward alone, without gradients")
    a = p.parse_args()
    labels = a.variants or [""]
    try:
        variants = [parse_variant(v) for v in labels]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    print(report(*run(a.configs, variants, a.rounds, a.device, a.compiled, a.mode), labels), flush=True)


if __name__ == "__main__":
    main()
