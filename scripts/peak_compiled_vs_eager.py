"""Peak memory of one forward + backward of the experts from no gradients, compiled first,
then eager (the order the benchmark does not use): whether compiling adds memory.

    python3 scripts/peak_compiled_vs_eager.py [--config mixtral]
"""

import argparse

import torch

import moeblaze_ops
from moeblaze_ops.bench.configs import CONFIGS, make_inputs
from moeblaze_ops.bench.measure import peak_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="mixtral", choices=sorted(CONFIGS))
    args = parser.parse_args()
    x, ids, w, w1, w2 = make_inputs(*CONFIGS[args.config])
    for t in (x, w, w1, w2):
        t.requires_grad_(True)
    grad = torch.randn_like(x)

    def layer():
        return moeblaze_ops.moe_experts(x, ids, w, w1, w2)

    def peak(fn):
        fn().backward(grad)  # warm-up (compiles)
        for t in (x, w, w1, w2):
            t.grad = None
        gb = peak_bytes(lambda: fn().backward(grad), "cuda") / 1e9
        for t in (x, w, w1, w2):
            t.grad = None
        return gb

    print(f"{args.config}: compiled {peak(torch.compile(layer, fullgraph=True)):.2f} GB, eager {peak(layer):.2f} GB")


if __name__ == "__main__":
    main()
