"""Time per token of training steps run back to back for seconds, as a training loop runs
them, with the GPU's SM clock, power and temperature over the run.

    python scripts/sustained_step.py [--configs mixtral] [--tokens 16384 65536 16384] [--seconds 20]
        [--device cuda|cpu]

The benchmark times a few steps after a short warm-up: at its own sizes that is mostly
before the GPU has reached its power limit, where the clocks are higher. A step of many
tokens is long enough to reach it within the timing, so its time per token looks worse
than a short step's even where the kernels scale perfectly. Here each (config, T) steps
forward + backward of moeblaze's layer (``moe_experts``, from no gradients) for
``--seconds``, each step timed by CUDA events; ``nvidia-smi`` samples the clock, power
and temperature every 250 ms, and the last three quarters of the samples (the settled
part) are averaged. Give a T twice, first and last, to see the first phase's heat carry
over. One row per phase:

    | config | T | steps | first ms | median ms | us per token | SM MHz | W | C |

On the CPU (``--device cpu``, for a check of the script) nothing is sampled.
"""

import argparse
import shutil
import subprocess
import time

import torch

from moeblaze_ops import moe_experts
from moeblaze_ops.bench import CONFIGS, make_inputs
from moeblaze_ops.bench.cli import positive_int

SAMPLES = ["clocks.sm", "power.draw", "temperature.gpu"]


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["mixtral"], choices=list(CONFIGS))
    p.add_argument("--tokens", nargs="+", type=positive_int, default=None, metavar="T",
                   help="the phases' token counts, in order (default: each config's own T)")
    p.add_argument("--seconds", type=float, default=20.0, help="how long each phase steps")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return p


def settled_means(lines):
    """The mean of each sampled quantity over the last three quarters of ``nvidia-smi``'s
    csv ``lines`` (the first quarter: the clocks still settling), lines it could not read
    ("[N/A]") left out; None without a readable line."""
    rows = []
    for line in lines:
        try:
            values = [float(v) for v in line.split(",")]
        except ValueError:
            continue
        if len(values) == len(SAMPLES):
            rows.append(values)
    rows = rows[len(rows) // 4:]
    return [sum(column) / len(column) for column in zip(*rows)] if rows else None


class Sampler:
    """``nvidia-smi`` sampling the clock, power and temperature every 250 ms from when it is
    made; ``settled()`` stops it and returns ``settled_means`` (None on the CPU or without
    ``nvidia-smi``)."""

    def __init__(self, device):
        self.proc = None
        if device == "cuda" and shutil.which("nvidia-smi"):
            index = torch.cuda.current_device()
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(SAMPLES)}", "--format=csv,noheader,nounits",
                 "-lms", "250"], stdout=subprocess.PIPE, text=True)

    def settled(self):
        if self.proc is None:
            return None
        self.proc.terminate()
        return settled_means(self.proc.stdout.read().splitlines())


def phase(name, T, seconds, device):
    """Steps the layer of config ``name`` at ``T`` tokens for ``seconds``; returns the row."""
    _, d, I, E, K = CONFIGS[name]
    x, ids, w, w_gate_up, w_down = make_inputs(T, d, I, E, K, device=device)
    params = (x, w_gate_up, w_down)
    for t in params:
        t.requires_grad_(True)
    grad = torch.randn_like(x)
    cuda = device == "cuda"

    def step():
        for t in params:
            t.grad = None
        moe_experts(x, ids, w, w_gate_up, w_down).backward(grad)

    step()  # compiles the kernels outside the timing
    if cuda:
        torch.cuda.synchronize()
    sampler = Sampler(device)
    times, start = [], time.perf_counter()
    while not times or time.perf_counter() - start < seconds:
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    median = sorted(times)[len(times) // 2]
    return dict(config=name, T=T, steps=len(times), first_ms=times[0], median_ms=median,
                us_per_token=median / T * 1e3, settled=sampler.settled())


def row(r):
    clock, power, temp = (f"{v:.0f}" for v in r["settled"]) if r["settled"] else ("-", "-", "-")
    return (f"| {r['config']} | {r['T']} | {r['steps']} | {r['first_ms']:.1f} | {r['median_ms']:.1f} | "
            f"{r['us_per_token']:.3f} | {clock} | {power} | {temp} |")


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU here: --device cpu")
    if not a.seconds > 0:
        p.error(f"--seconds must be positive, got {a.seconds}")
    print("| config | T | steps | first ms | median ms | us per token | SM MHz | W | C |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    rows = []
    for name in a.configs:
        for T in a.tokens or [CONFIGS[name][0]]:
            rows.append(phase(name, T, a.seconds, a.device))
            print(row(rows[-1]), flush=True)
            if a.device == "cuda":
                torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
