"""Prints the code Inductor generates for ``residual + moe_experts(x)``, forward and backward:
which moeblaze template kernels the graph holds and what their epilogues fuse.

    python3 scripts/compiled_code.py [--config olmoe] [--tokens 4096] [--set column_slab=None]
"""

import argparse

import torch
from torch._inductor.utils import run_and_get_code

import moeblaze_ops
from moeblaze_ops.bench.cli import parse_setting
from moeblaze_ops.bench.configs import CONFIGS, make_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="olmoe", choices=sorted(CONFIGS))
    parser.add_argument("--tokens", type=int, default=4096, help="tokens (fewer than the config's, to compile fast)")
    parser.add_argument("--set", action="append", default=[], type=parse_setting, metavar="NAME=VALUE")
    args = parser.parse_args()
    _, d, I, E, K = CONFIGS[args.config]
    x, ids, tw, w1, w2 = make_inputs(args.tokens, d, I, E, K)
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    residual = torch.randn_like(x)

    def step(x, residual):
        out = residual + moeblaze_ops.moe_experts(x, ids, tw, w1, w2)
        out.float().square().mean().backward()
        return out

    with moeblaze_ops.settings.override(**dict(args.set)):
        _, codes = run_and_get_code(torch.compile(step), x.requires_grad_(True), residual)
    for i, code in enumerate(codes):
        print(f"# ---------------------------------------------------------------- graph {i}")
        print(code)


if __name__ == "__main__":
    main()
