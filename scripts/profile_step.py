"""Where a forward + backward of the experts spends its time: a torch.profiler table per
peer (kernels by device time, and the host time of the whole step).

    python scripts/profile_step.py [--configs qwen3_100m olmoe] [--peers moeblaze hf_grouped_mm_compiled]
        [--steps 5] [--device cuda|cpu] [--rows 25] [--cudagraphs] [--host-rows 25] [--trace DIR]
        [--gaps 15] [--set NAME=VALUE ...] [--peer-site DIR]

Small layers (the 100M example) are where the host side shows: compare "host ms per
step" with "device ms per step". ``--host-rows`` adds a table sorted by host (self CPU) time, and ``--trace`` writes
one Chrome trace per config and peer (open in Perfetto: the host's gaps between launches).
``--gaps N`` reads the trace's device activity (kernels, copies, fills) and prints the GPU's
idle time per step: the total, how much of it came in gaps under 10 us (launch to launch)
and the N longest gaps with the activity on either side.
"""

import argparse
import json
import os
import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from moeblaze_ops import settings
from moeblaze_ops.bench import CONFIGS, make_inputs, peers
from moeblaze_ops.bench.cli import add_peer_sites, parse_setting


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="*", default=["qwen3_100m", "olmoe"], choices=list(CONFIGS))
    p.add_argument("--peers", nargs="*", default=["moeblaze", "hf_grouped_mm_compiled"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--cudagraphs", action="store_true",
                   help="offer the CUDA-graph peers too (hf_grouped_mm_cudagraphs, moeblaze_cudagraphs)")
    p.add_argument("--host-rows", type=int, default=0, help="rows of a table sorted by host time (0: none)")
    p.add_argument("--trace", default=None, help="a folder to write Chrome traces into")
    p.add_argument("--gaps", type=int, default=0, help="print the GPU's idle time and this many longest gaps")
    p.add_argument("--set", dest="settings", metavar="NAME=VALUE", action="append", type=parse_setting, default=[],
                   help="change a kernel setting for the whole run (repeatable), as the benchmark's --set")
    p.add_argument("--peer-site", metavar="DIR", action="append", default=[],
                   help="a site directory a peer is installed into (SonicMoE: see scripts/sonicmoe_peer.sh)")
    a = p.parse_args()
    add_peer_sites(p, a.peer_site)
    with settings.override(**dict(a.settings)):
        _profile(a)


def _profile(a):
    cuda = a.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name in a.configs:
        T, d, I, E, K = CONFIGS[name]
        torch._dynamo.reset()
        x, ids, w, w_gate_up, w_down = make_inputs(T, d, I, E, K, device=a.device)
        for t in (x, w, w_gate_up, w_down):
            t.requires_grad_(True)
        grad = torch.randn_like(x)
        fns = peers(x, ids, w, w_gate_up, w_down, train=True, cuda_graphs=a.cudagraphs)
        for peer in a.peers:
            if peer not in fns:
                print(f"\n## {name} {peer}: not available here (peers: {', '.join(fns)})", flush=True)
                continue
            fn = fns[peer]

            def step():
                for t in (x, w, w_gate_up, w_down):  # as after zero_grad(set_to_none=True)
                    t.grad = None
                fn().backward(grad)

            for _ in range(3):  # compile, first launches
                step()
            if cuda:
                torch.cuda.synchronize()
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    step()
                host = (time.perf_counter() - t0) / a.steps * 1e3
                if cuda:
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / a.steps * 1e3
            events = prof.key_averages()
            # Kernels only: an op's row repeats the device time of the kernels it launched
            # (the sum over every row was twice the step's device time).
            device = sum(e.self_device_time_total for e in events
                         if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / a.steps / 1e3
            device = device if cuda else float("nan")
            print(f"\n## {name} {peer}: host ms per step {host:.2f} (launching), wall {wall:.2f}, "
                  f"device ms per step {device:.2f}", flush=True)
            sort = "self_device_time_total" if cuda else "self_cpu_time_total"
            print(events.table(sort_by=sort, row_limit=a.rows), flush=True)
            if a.host_rows and cuda:
                print(events.table(sort_by="self_cpu_time_total", row_limit=a.host_rows), flush=True)
            if a.trace:
                os.makedirs(a.trace, exist_ok=True)
                prof.export_chrome_trace(os.path.join(a.trace, f"{name}-{peer}.json"))
            if a.gaps and cuda:
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "trace.json")
                    prof.export_chrome_trace(path)
                    _print_gaps(path, a.steps, a.gaps)
            for t in (x, w, w_gate_up, w_down):
                t.grad = None
        del fns, x, w, w_gate_up, w_down
        if cuda:
            torch.cuda.empty_cache()


_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _print_gaps(trace_path, steps, rows):
    """The GPU's idle time between its first and last activity in the trace: the device
    events merged over streams, each gap with the activity that ended before it and the
    one that started after it."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("cat") in _DEVICE_CATEGORIES and e.get("ph") == "X"]
    events.sort(key=lambda e: e["ts"])
    gaps, end, last = [], None, None
    for e in events:
        if end is not None and e["ts"] > end:
            gaps.append((e["ts"] - end, last["name"], e["name"]))
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    idle = sum(g for g, _, _ in gaps)
    short = sum(g for g, _, _ in gaps if g < 10)
    span = (end - events[0]["ts"]) if events else 0.0
    print(f"GPU idle per step: {idle / steps / 1e3:.3f} ms of {span / steps / 1e3:.3f} ms "
          f"({sum(1 for g, _, _ in gaps) / steps:.0f} gaps a step; {short / steps / 1e3:.3f} ms in gaps under 10 us)")
    print("| gap us | before | after |\n| --- | --- | --- |")
    for g, before, after in sorted(gaps, reverse=True)[:rows]:
        print(f"| {g:.1f} | {before[:60]} | {after[:60]} |")


if __name__ == "__main__":
    main()
