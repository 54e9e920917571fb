"""What is alive at the peak of one forward + backward (GPU): the largest blocks at the
moment of peak allocated memory, with the Python lines that allocated them. The traced
step starts with no gradients allocated, as the benchmark's peak does, so its weight
gradients are new blocks (not accumulated into the warm-up's).

    python scripts/memory_peak.py [--config conf3] [--peers moeblaze moeblaze_recompute] [--top 8]

Replays the CUDA caching allocator's trace (torch.cuda.memory._record_memory_history).
"""

import argparse

import torch

from moeblaze_ops.bench import CONFIGS, make_inputs, peers


def live_at_peak(trace):
    live, cur, peak, at_peak = {}, 0, 0, []
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, list(live.values())
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    return peak, at_peak


def where(ev, depth=3):
    frames = [f for f in ev.get("frames", []) if "moeblaze" in f["filename"] or "bench" in f["filename"]]
    return " <- ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}({f['name']})" for f in frames[:depth])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="conf3", choices=list(CONFIGS))
    p.add_argument("--peers", nargs="*", default=["moeblaze", "moeblaze_recompute"])
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args()
    inputs = make_inputs(*CONFIGS[a.config])
    for t in (inputs[0], inputs[2], inputs[3], inputs[4]):
        t.requires_grad_(True)
    grad = torch.randn_like(inputs[0])
    fns = peers(*inputs, train=True)
    for peer in a.peers:
        fns[peer]().backward(grad)  # warm up
        for t in inputs:
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        fns[peer]().backward(grad)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, blocks = live_at_peak(snap["device_traces"][torch.cuda.current_device()])
        print(f"## {a.config} {peer}: peak {peak / 1e9:.2f} GB above {base / 1e9:.2f} GB allocated before the step")
        for ev in sorted(blocks, key=lambda e: -e["size"])[:a.top]:
            print(f"  {ev['size'] / 1e9:6.3f} GB  {where(ev)}")


if __name__ == "__main__":
    main()
