"""Where the host time of a small forward + backward goes (GPU): wall time per step, then
the Python functions by own time under cProfile.

    python scripts/host_overhead.py [--config qwen3_100m] [--steps 200] [--rows 30]

Small layers are launch-bound: the device finishes each kernel before the host has
launched the next, so every microsecond here is a microsecond of the step.
"""

import argparse
import cProfile
import pstats
import time

import torch

import moeblaze_ops
from moeblaze_ops.bench import CONFIGS, make_inputs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="qwen3_100m", choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rows", type=int, default=30)
    a = p.parse_args()
    x, ids, w, wgu, wd = make_inputs(*CONFIGS[a.config])
    for t in (x, w, wgu, wd):
        t.requires_grad_(True)
    g = torch.randn_like(x)

    def step():
        moeblaze_ops.moe_experts(x, ids, w, wgu, wd).backward(g)

    def steps(n):
        for _ in range(n):
            step()
        torch.cuda.synchronize()

    steps(10)
    t0 = time.perf_counter()
    steps(a.steps)
    print(f"{a.config}: {(time.perf_counter() - t0) / a.steps * 1e3:.3f} ms per forward + backward (wall)")
    prof = cProfile.Profile()
    prof.runcall(steps, a.steps)
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.rows)


if __name__ == "__main__":
    main()
