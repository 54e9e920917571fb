"""Expert parallelism against one device: tokens/s of one EP layer (forward + backward),
the single-device layer on the same per-rank batch, and the straggler ratio under skewed
routing.

    torchrun --nproc-per-node 2 -m moeblaze_ops.bench.expert_parallel --configs olmoe mixtral --out DIR
    python -m moeblaze_ops.bench.expert_parallel --spawn 2 --device cpu --configs smoke --out DIR   # gloo smoke

Each rank holds T tokens (the config's T) and E / N experts. Rows:

- ``single``: one device runs its T tokens through all E experts (``moe_experts``);
- ``moeblaze_ep``: the N ranks run N*T tokens through ``moe_experts_ep``;
- ``hf_all_to_all_ep`` (when transformers has ``AllToAllEP``): transformers' all-to-all
  EP around its ``grouped_mm`` experts, on the same tokens and weights.

tokens/s counts every rank's tokens; the speedup is EP tokens/s over single tokens/s. The
straggler ratio is the slowest rank's local expert time over the median rank's, under
Zipf-skewed routing (``--zipf``). Every rank runs the same fixed number of steps (the
collectives need it), timed with device events where there are any. NVLink multicast
stays off (the launcher's environment is set before the process group starts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moeblaze_ops import moe_experts
from moeblaze_ops.bench.configs import CONFIGS
from moeblaze_ops.expert_parallel import combine_from_experts, dispatch_to_experts

#: NVLink multicast off: these machines' notes ask for it, and the tests check it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _routing(T, E, K, zipf, generator, device):
    """Top-K ids and softmax weights; ``zipf`` > 0 skews the expert popularity (rank^-zipf)."""
    logits = torch.randn(T, E, generator=generator, device=device)
    if zipf > 0:
        logits += -zipf * torch.log(torch.arange(1, E + 1, device=device, dtype=torch.float32))
    weights, ids = logits.softmax(-1).topk(K, dim=-1)
    return ids, weights


def _layer(cfg, rank, world, device, zipf):
    """This rank's tokens and routing, and the full weights (the same on every rank)."""
    T, d, I, E, K = CONFIGS[cfg]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g_w = torch.Generator(device=device).manual_seed(0)
    w_gate_up = torch.randn(E, 2 * I, d, generator=g_w, device=device, dtype=dtype) * d ** -0.5
    w_down = torch.randn(E, d, I, generator=g_w, device=device, dtype=dtype) * I ** -0.5
    g = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(T, d, generator=g, device=device, dtype=dtype)
    ids, weights = _routing(T, E, K, zipf, g, device)
    return x, ids, weights, w_gate_up, w_down


class _Timer:
    """Milliseconds of a region, with device events on CUDA and the host clock elsewhere."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3

    def elapsed(self):
        if self.cuda:
            torch.cuda.synchronize()
            return self.start.elapsed_time(self.end)
        return self.ms


def _median_ms(step, device, warmup, reps, group=None):
    """Median ms of ``step()`` over ``reps`` runs after ``warmup``; every rank runs the same count."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if group is not None:
            dist.barrier(group)
        with _Timer(device) as t:
            step()
        times.append(t.elapsed())
    return statistics.median(times)


def _ep_step(x, ids, weights, w_gate_up, w_down, group, expert_times, device):
    """One forward + backward of the moeblaze EP layer; the local experts' time goes to ``expert_times``."""
    rows, local_expert, exchange = dispatch_to_experts(x, ids, weights, w_gate_up.shape[0], group)
    ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    with _Timer(device) as t:
        expert_rows = moe_experts(rows, local_expert[:, None], ones, w_gate_up, w_down)
    out = combine_from_experts(expert_rows, exchange)
    out.backward(torch.ones_like(out))
    expert_times.append(t.elapsed())


def _hf_all_to_all(x, w_gate_up, w_down, group, device):
    """transformers' AllToAllEP around its grouped_mm experts, or None when it has none."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.expert_parallel import AllToAllEP
        from transformers.integrations.moe import grouped_mm_experts_forward
    except ImportError:
        return None
    from moeblaze_ops.bench.implementations import HFExpertsModule

    experts = HFExpertsModule(w_gate_up, w_down)
    experts.forward = lambda h, i, w: grouped_mm_experts_forward(experts, h, i, w)
    mesh = init_device_mesh(device.type, (dist.get_world_size(group), 1), mesh_dim_names=("ep", "tp"))
    return AllToAllEP(experts, mesh["ep"], mesh["tp"])


def run(args, rank, world, device):
    group = dist.group.WORLD
    rows = []
    for cfg in args.configs:
        T, d, I, E, K = CONFIGS[cfg]
        x, ids, weights, w_gate_up, w_down = _layer(cfg, rank, world, device, args.zipf)
        shard = slice(rank * E // world, (rank + 1) * E // world)
        local = [w[shard].detach().clone().requires_grad_(True) for w in (w_gate_up, w_down)]
        x.requires_grad_(True)
        weights.requires_grad_(True)
        flops_per_token = 6 * K * d * I * 3  # forward + backward of the two GEMMs

        def single():
            moe_experts(x, ids, weights, w_gate_up.requires_grad_(True), w_down.requires_grad_(True)).sum().backward()

        single_ms = _median_ms(single, device, args.warmup, args.reps)
        expert_times = []
        ep_ms = _median_ms(lambda: _ep_step(x, ids, weights, *local, group, expert_times, device), device,
                           args.warmup, args.reps, group)
        row = dict(config=cfg, world=world, zipf=args.zipf, single_ms=single_ms, ep_ms=ep_ms,
                   single_tokens_per_s=T / single_ms * 1e3, ep_tokens_per_s=world * T / ep_ms * 1e3,
                   expert_ms=statistics.median(expert_times[args.warmup:] or expert_times),
                   tflops_per_rank=T * flops_per_token / ep_ms / 1e9)
        hf = _hf_all_to_all(x, *local, group, device)
        if hf is not None:
            def hf_step():
                hf(x, ids, weights).sum().backward()

            hf_ms = _median_ms(hf_step, device, args.warmup, args.reps, group)
            row.update(hf_ep_ms=hf_ms, hf_ep_tokens_per_s=world * T / hf_ms * 1e3)
        gathered = [None] * world
        dist.all_gather_object(gathered, row, group)
        if rank == 0:
            expert = [r["expert_ms"] for r in gathered]
            merged = dict(gathered[0], ep_ms=max(r["ep_ms"] for r in gathered),
                          straggler_ratio=max(expert) / statistics.median(expert), expert_ms_per_rank=expert)
            merged["ep_tokens_per_s"] = world * T / merged["ep_ms"] * 1e3
            merged["ep_speedup_vs_single"] = merged["ep_tokens_per_s"] / merged["single_tokens_per_s"]
            if "hf_ep_ms" in merged:
                merged["hf_ep_ms"] = max(r["hf_ep_ms"] for r in gathered)
                merged["hf_ep_tokens_per_s"] = world * T / merged["hf_ep_ms"] * 1e3
                merged["ep_speedup_vs_hf"] = merged["ep_tokens_per_s"] / merged["hf_ep_tokens_per_s"]
            rows.append(merged)
            print(json.dumps(merged), flush=True)
    return rows


def report(rows):
    lines = ["| config | ranks | zipf | single tokens/s | moeblaze EP tokens/s | speedup | HF AllToAllEP tokens/s "
             "| vs HF | straggler (slowest / median expert time) |", "|" + " --- |" * 9]
    for r in rows:
        hf = f"{r['hf_ep_tokens_per_s']:.0f}" if "hf_ep_tokens_per_s" in r else "-"
        vs_hf = f"{r['ep_speedup_vs_hf']:.2f}x" if "ep_speedup_vs_hf" in r else "-"
        lines.append(f"| {r['config']} | {r['world']} | {r['zipf']} | {r['single_tokens_per_s']:.0f} "
                     f"| {r['ep_tokens_per_s']:.0f} | {r['ep_speedup_vs_single']:.2f}x | {hf} | {vs_hf} "
                     f"| {r['straggler_ratio']:.2f} |")
    return "\n".join(lines)


def _main_rank(rank, world, args):
    os.environ.update(MULTICAST_OFF)
    device = torch.device(args.device, rank if args.device == "cuda" else None) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        rows = run(args, rank, world, device)
        if rank == 0:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_ep.json").write_text(json.dumps(rows, indent=1))
            (out / "bench_ep.md").write_text(report(rows) + "\n")
            print(report(rows), flush=True)
    finally:
        dist.destroy_process_group()


def _spawned(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _main_rank(rank, world, args)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m moeblaze_ops.bench.expert_parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["olmoe", "mixtral"], choices=list(CONFIGS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda: NCCL, one GPU per rank; cpu: gloo")
    p.add_argument("--zipf", type=float, default=1.0, help="routing skew exponent (0: uniform)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row")
    p.add_argument("--reps", type=int, default=10, help="timed steps per row (the median is reported)")
    p.add_argument("--spawn", type=int, default=0, help="start this many local processes instead of torchrun's")
    p.add_argument("--out", default="bench_ep_out")
    args = p.parse_args(argv)
    if args.spawn:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_spawned, args=(args.spawn, port, args), nprocs=args.spawn, start_method="spawn")
    else:
        _main_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
