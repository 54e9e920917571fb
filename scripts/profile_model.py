"""Where a training step of the example's HuggingFace MoE model spends its time, per
experts backend: host and device ms per step, then torch.profiler tables (by device time
and by host time) and, with ``--trace``, a Chrome trace per backend.

    python scripts/profile_model.py [--size 100m] [--impl moeblaze grouped_mm] [--compile [MODE]]
        [--steps 5] [--rows 25] [--trace DIR]

The model, data and optimizer are the example's (examples/finetune_hf_moe.py); the step
is the example's without its per-step loss read, which would wait for the GPU.
"""

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

import moeblaze_ops.hf
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
    p.add_argument("--impl", nargs="+", default=["moeblaze", "grouped_mm"])
    p.add_argument("--compile", nargs="?", const="default", choices=example.COMPILE_MODES)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--trace", default=None, help="a folder to write Chrome traces into")
    a = p.parse_args()
    torch.manual_seed(0)
    config = model_config("qwen3_moe", max_positions=512, **example.SIZES[a.size])
    state = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).state_dict()
    for impl in a.impl:
        torch._dynamo.reset()
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(state)
        model.to("cuda").train()
        model.set_experts_implementation(impl)
        if impl in moeblaze_ops.hf.BACKENDS:
            moeblaze_ops.hf.check_model(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = model
        if a.compile:
            with torch.no_grad():
                model(torch.zeros(1, 8, dtype=torch.long, device="cuda"))
            run = torch.compile(model, fullgraph=True, mode=a.compile)
        ids = torch.randint(0, config.vocab_size, (a.batch, a.seq), device="cuda")

        def step():
            if a.compile == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            run(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            host = (time.perf_counter() - t0) / a.steps * 1e3
            torch.cuda.synchronize()
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
        del model, opt, run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
