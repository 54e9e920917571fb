"""Host time per training step of a small, host-bound experts layer: forward + backward of
the 100M example's layer (``--config qwen3_100m``: 8192 tokens, d 512, I 256, 32 experts,
top 4; ``qwen3_100m_b512`` is the example's own batch of 512 tokens), measured with
torch.profiler, the minimum over repeats.

    python scripts/host_overhead.py [--config qwen3_100m] [--steps 50] [--repeats 5] [--compile]
        [--device cuda|cpu]

A small layer is launch-bound: the device finishes each kernel before the host has
launched the next, so every microsecond of the host's is a microsecond of the step. Each
repeat profiles ``--steps`` steps (each from no gradients, as after
``zero_grad(set_to_none=True)``), each step inside a ``record_function`` range: a step's
host time is that range's length on the host (the profiler's own bookkeeping included,
alike for every version of the package measured), its device time the time of the
kernels the profiler records. The repeat with the least host time counts (the host's
speed drifts between repeats). The profiler's bookkeeping is not alike for every kind of
call, though: it costs a kernel registered from Python (the backward ops' autograd
kernels, for one) far more than the microseconds such a call takes unprofiled. So the
same steps are also timed with no profiler at all, on the wall clock between two
synchronisations: a host-bound step's wall time is its host time. Prints one line:

    host ms per step 1.234 (min of 5 repeats of 50 steps), wall ms per step unprofiled 1.100, device ms per step 0.456: qwen3_100m eager on cuda

``scripts/gpu_check.sh`` runs it for this checkout's package and for an older copy's
(``PYTHONPATH``), so it needs only ``moeblaze_ops.moe_experts`` and the benchmark's
``CONFIGS`` and ``make_inputs``.
"""

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from moeblaze_ops import moe_experts
from moeblaze_ops.bench import CONFIGS, make_inputs

STEP = "moeblaze_host_overhead_step"


def measure(config, device, steps, repeats, compiled=False):
    """(host ms per step, device ms per step) of the profiled repeat with the least host
    time, and the least wall ms per step of as many unprofiled repeats."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x, ids, w, w_gate_up, w_down = make_inputs(*CONFIGS[config], device=device)
    params = (x, w, w_gate_up, w_down)
    for t in params:
        t.requires_grad_(True)
    grad = torch.randn_like(x)
    layer = torch.compile(moe_experts, fullgraph=True) if compiled else moe_experts

    def step():
        for t in params:
            t.grad = None
        layer(x, ids, w, w_gate_up, w_down).backward(grad)

    for _ in range(10):  # compile, first launches, the allocator's pool
        step()
    sync()
    best = None
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(steps):
                with record_function(STEP):
                    step()
            sync()
        host = sum(e.time_range.elapsed_us() for e in prof.events()
                   if e.name == STEP and e.device_type == DeviceType.CPU) / steps / 1e3
        device_ms = sum(e.self_device_time_total for e in prof.key_averages()
                        if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / steps / 1e3
        if best is None or host < best[0]:
            best = (host, device_ms if cuda else float("nan"))
        time.sleep(0.05)  # let the device drain and the host settle between repeats
    wall = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = min(wall, (time.perf_counter() - start) / steps * 1e3)
        time.sleep(0.05)
    return (*best, wall)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3_100m", choices=list(CONFIGS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=50, help="steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="repeats; the one with the least host time counts")
    p.add_argument("--compile", action="store_true", help="the layer under torch.compile(fullgraph=True)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.repeats < 1:
        p.error("--steps and --repeats must be at least 1")
    host, device, wall = measure(a.config, a.device, a.steps, a.repeats, a.compile)
    print(f"host ms per step {host:.3f} (min of {a.repeats} repeats of {a.steps} steps), wall ms per step "
          f"unprofiled {wall:.3f}, device ms per step {device:.3f}: {a.config} "
          f"{'compiled' if a.compile else 'eager'} on {a.device}", flush=True)
    return host, device, wall


if __name__ == "__main__":
    main()
