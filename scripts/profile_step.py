"""Where a training step spends its time, kernel by kernel: a torch.profiler table per peer
(kernels by device time) and the step's host, wall and device milliseconds.

    python scripts/profile_step.py [--configs qwen3_100m olmoe] [--peers moeblaze hf_grouped_mm_compiled]
        [--tokens T ...] [--tilt X] [--hot X] [--empty N] [--steps 5] [--device cuda|cpu] [--rows 25]
        [--host-rows 25] [--trace DIR] [--gaps 15] [--cudagraphs] [--set NAME=VALUE ...] [--peer-site DIR]
    python scripts/profile_step.py --model 100m [--impl moeblaze grouped_mm] [--compile [MODE]]
        [--batch 8] [--seq 64] [...]

    python scripts/profile_step.py --decode T [T ...] [--decode-configs qwen3_a3b_decode mixtral_decode]
        [--decode-peers moeblaze_graph moeblaze_cudagraphs grouped_mm_compiled] [--layers 8] [...]

The first form profiles forward + backward of one experts layer: the benchmark's shapes
(``--configs``) and peers (``--peers``, the names ``python -m moeblaze_ops.bench --skip``
takes), its routing imbalanced as the benchmark's (``--tilt``, ``--hot``, ``--empty``).
``--model SIZE`` profiles instead a training step (forward, backward, AdamW) of the
example's HuggingFace model (``examples/finetune_hf_moe.py --size SIZE``), once per experts
backend ``--impl``; ``--compile`` compiles the model as the example does.

``--decode`` profiles instead the decode benchmark's forward at T tokens (``--mode decode``
of ``python -m moeblaze_ops.bench``): a step is one replay of a peer's stack of ``--layers``
layers in one graph, on two copies of the weights in turn, under ``torch.inference_mode``.

Small layers (the 100M example) are where the host side shows: compare "host ms per
step" with "device ms per step". ``--host-rows`` adds a table sorted by host (self CPU)
time, ``--trace`` writes one Chrome trace per step profiled (open in Perfetto: the host's
gaps between launches), and ``--gaps N`` prints the GPU's idle time per step: the total,
how much of it came in gaps under 10 us (launch to launch) and the N longest gaps with
the activity on either side.
"""

import argparse
import importlib.util
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from moeblaze_ops import settings
from moeblaze_ops.bench import CONFIGS, decode, make_inputs, peers
from moeblaze_ops.bench.cli import (add_peer_sites, check_empty_configs, finite_float, non_negative_int,
                                    parse_setting, positive_int, setting_changes)
from moeblaze_ops.bench.configs import DECODE_SHAPES
from moeblaze_ops.bench.implementations import PEER_NAMES, train_step

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_hf_moe.py"


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["qwen3_100m", "olmoe"], choices=list(CONFIGS))
    p.add_argument("--peers", nargs="+", default=["moeblaze", "hf_grouped_mm_compiled"], choices=PEER_NAMES,
                   metavar="PEER", help=f"of: {', '.join(PEER_NAMES)}")
    p.add_argument("--tokens", nargs="+", type=positive_int, default=None, metavar="T",
                   help="the layer at these token counts in place of each config's own T (a profile each)")
    p.add_argument("--tilt", type=finite_float, default=0.0, metavar="X",
                   help="imbalanced routing, as the benchmark's --tilt: X * linspace(1, 0, E) added to the logits")
    p.add_argument("--hot", type=finite_float, default=0.0, metavar="X",
                   help="as the benchmark's --hot: X added to expert 0's logit (one hot expert)")
    p.add_argument("--empty", type=non_negative_int, default=0, metavar="N",
                   help="as the benchmark's --empty: the last N experts get no tokens")
    p.add_argument("--model", metavar="SIZE", default=None,
                   help="profile the example's model of this --size (tiny, small, 100m) instead of one layer")
    p.add_argument("--impl", nargs="+", default=["moeblaze", "grouped_mm"],
                   help="with --model: the experts backends (experts_implementation) to profile")
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   help="with --model: the model under torch.compile(fullgraph=True, mode=MODE)")
    p.add_argument("--decode", nargs="+", type=positive_int, default=None, metavar="T",
                   help="profile the decode forward at these token counts instead of a training step")
    p.add_argument("--decode-configs", nargs="+", default=["qwen3_a3b_decode"], choices=list(DECODE_SHAPES),
                   help="with --decode: the decode shapes")
    p.add_argument("--decode-peers", nargs="+", default=list(decode.CUDA_PEERS), choices=list(decode.CUDA_PEERS),
                   help="with --decode: the graph peers whose stacks are profiled")
    p.add_argument("--layers", type=positive_int, default=8, help="with --decode: layers in a step's graph")
    p.add_argument("--batch", type=int, default=8, help="with --model: sequences per step")
    p.add_argument("--seq", type=int, default=64, help="with --model: tokens per sequence")
    p.add_argument("--steps", type=int, default=5, help="steps profiled (after 3 untimed ones)")
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
    return p


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU here: --device cpu")
    changes = setting_changes(p, a.settings)
    add_peer_sites(p, a.peer_site)
    if not (a.model or a.decode):  # the layers' routing, checked before anything runs
        check_empty_configs(p, a.configs, a.empty)
    with settings.override(**changes):
        steps = model_steps(p, a) if a.model else decode_steps(a) if a.decode else layer_steps(a)
        for label, step in steps:
            profile_step(a, label, step)


def _release(device):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def layer_steps(a):
    """(label, step) per config and peer: one forward + backward of the benchmark's layer,
    from no gradients (as after ``zero_grad(set_to_none=True)``)."""
    for name, T in ((n, t) for n in a.configs for t in a.tokens or [CONFIGS[n][0]]):
        _, d, I, E, K = CONFIGS[name]
        torch._dynamo.reset()
        x, ids, w, w_gate_up, w_down = make_inputs(T, d, I, E, K, device=a.device, tilt=a.tilt, hot=a.hot,
                                                   empty=a.empty)
        if a.tokens or a.tilt or a.hot or a.empty:
            name = (f"{name} T={T}" + (f" tilt={a.tilt:g}" if a.tilt else "") + (f" hot={a.hot:g}" if a.hot else "")
                    + (f" empty={a.empty}" if a.empty else ""))
        params = (x, w, w_gate_up, w_down)
        for t in params:
            t.requires_grad_(True)
        grad = torch.randn_like(x)
        fns = peers(x, ids, w, w_gate_up, w_down, train=True, cuda_graphs=a.cudagraphs)
        for peer in a.peers:
            if peer not in fns:
                print(f"\n## {name} {peer}: not available here (peers: {', '.join(fns)})", flush=True)
                continue

            def step(fn=fns[peer]):
                for t in params:
                    t.grad = None
                train_step(fn, grad)

            yield f"{name} {peer}", step
        del fns, x, ids, w, w_gate_up, w_down, params, grad
        _release(a.device)


def decode_steps(a):
    """(label, step) per decode shape, T and graph peer: one replay of the peer's stack of
    ``a.layers`` layers (the decode benchmark's ``stack_call``) without gradients."""
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    for shape in a.decode_configs:
        d, I, E, K = DECODE_SHAPES[shape]
        weights = decode.make_weights(d, I, E, 2, dtype, a.device, 0)
        for T in a.decode:
            draws = decode.build_draws(T, K, weights, dtype, a.device, 0)
            if a.device == "cuda":
                decode.mark_static(draws)
            for peer in a.decode_peers:
                torch._dynamo.reset()
                with torch.inference_mode():
                    call = decode.stack_call(peer, draws, a.layers)

                def step(call=call):
                    with torch.inference_mode():
                        call()

                yield f"{shape} T={T} {peer} ({a.layers} layers a step)", step
                del call
                _release(a.device)
        del weights
        _release(a.device)


def model_steps(p, a):
    """(label, step) per experts backend: the example's training step of its model."""
    from transformers import AutoModelForCausalLM

    from moeblaze_ops.hf import model_config

    spec = importlib.util.spec_from_file_location("finetune_hf_moe", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    if a.model not in example.SIZES:
        p.error(f"--model: unknown size {a.model!r}; the example's sizes: {', '.join(example.SIZES)}")
    if a.compile is not None and a.compile not in example.COMPILE_MODES:
        p.error(f"--compile: unknown mode {a.compile!r}; modes: {', '.join(example.COMPILE_MODES)}")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    torch.manual_seed(0)
    config = model_config("qwen3_moe", max_positions=max(512, a.seq), **example.SIZES[a.model])
    state = AutoModelForCausalLM.from_config(config, dtype=dtype).state_dict()
    ids = torch.randint(0, config.vocab_size, (a.batch, a.seq), device=a.device)
    for impl in a.impl:
        torch._dynamo.reset()
        run, opt = example.build_model(config, state, impl, device=a.device, dtype=dtype, compile_mode=a.compile,
                                       lr=1e-3)
        yield (f"{a.model} model {impl}" + (f" compiled {a.compile}" if a.compile else ""),
               lambda: example.train_step(run, opt, ids, a.compile))
        del run, opt
        _release(a.device)


def profile_step(a, label, step):
    """Prints host, wall and device ms per step and the profiler's tables; writes a trace."""
    cuda = a.device == "cuda"
    for _ in range(3):  # compile, first launches
        step()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        host = (time.perf_counter() - t0) / a.steps * 1e3
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / a.steps * 1e3
    events = prof.key_averages()
    # Kernels only: an op's row repeats the device time of the kernels it launched.
    device = sum(e.self_device_time_total for e in events
                 if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / a.steps / 1e3
    print(f"\n## {label}: host ms per step {host:.2f} (launching), wall {wall:.2f}, "
          f"device ms per step {device if cuda else float('nan'):.2f}", flush=True)
    print(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=a.rows),
          flush=True)
    if a.host_rows and cuda:
        print(events.table(sort_by="self_cpu_time_total", row_limit=a.host_rows), flush=True)
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(a.trace, re.sub(r"[^\w.-]+", "-", label) + ".json"))
    if a.gaps and cuda:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            print_gaps(path, a.steps, a.gaps)


_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def print_gaps(trace_path, steps, rows):
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
          f"({len(gaps) / steps:.0f} gaps a step; {short / steps / 1e3:.3f} ms in gaps under 10 us)")
    print("| gap us | before | after |\n| --- | --- | --- |")
    for g, before, after in sorted(gaps, reverse=True)[:rows]:
        print(f"| {g:.1f} | {before[:60]} | {after[:60]} |")


if __name__ == "__main__":
    main()
