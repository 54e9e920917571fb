"""Expert parallelism, "all_to_all" mode, on gloo with two processes (CPU): outputs and every
gradient equal one process holding all experts, for several routings, eager and compiled
(fullgraph); transformers' ep_implementation="moeblaze" against a one-process model."""

import datetime
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeblaze_ops.testing import make_layer, rel_err

WORLD = 2
GRADS = ("x", "topk_weights", "w_gate_up", "w_down", "b_gate_up", "b_down")
# name: (tokens per rank, routing, sentinel fraction, dtype)
CASES = {
    "random": ((24, 17), "uniform", 0.0, torch.float32),
    "skewed_bias_sentinels": ((20, 31), "skewed", 0.2, torch.float32),
    "all_to_rank0": ((16, 16), "first", 0.0, torch.float32),
    "empty_rank": ((0, 23), "uniform", 0.0, torch.float32),
    "bf16": ((32, 12), "uniform", 0.0, torch.bfloat16),
}
E, K, D, I = 8, 2, 16, 8
#: Cases also run through torch.compile(fullgraph=True).
COMPILED_CASES = ("random", "skewed_bias_sentinels", "empty_rank")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(name, seed):
    """Every rank's tokens (the same on every rank: each builds all of them) and the full weights."""
    tokens, routing, sentinel_frac, dtype = CASES[name]
    full = make_layer(sum(tokens), D, I, E, K, dtype=dtype, routing=routing, sentinel_frac=sentinel_frac, seed=seed,
                      bias=name.startswith("skewed"), tw_dtype=torch.float32)
    return tokens, full


def _run_case(name, rank, seed, compiled=False, device="cpu"):
    from moeblaze_ops import moe_experts
    from moeblaze_ops.expert_parallel import moe_experts_ep

    tokens, full = _inputs(name, seed)
    full = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in full.items()}
    lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
    shard = slice(rank * E // WORLD, (rank + 1) * E // WORLD)
    names = [k for k in GRADS if full[k] is not None]
    grad_out = torch.randn(sum(tokens), D, generator=torch.Generator().manual_seed(seed + 1)).to(full["x"])

    # One process with every expert and every rank's tokens: the reference.
    ref_in = {k: (v.detach().clone().requires_grad_(k in names) if k in names else v) for k, v in full.items()}
    ref_out = moe_experts(**ref_in)
    ref_grads = dict(zip(names, torch.autograd.grad(ref_out, [ref_in[k] for k in names], grad_out)))

    def ep_run():
        mine = {k: v.detach().clone().requires_grad_(True) for k, v in
                (("x", full["x"][lo:hi]), ("topk_weights", full["topk_weights"][lo:hi]),
                 ("w_gate_up", full["w_gate_up"][shard]), ("w_down", full["w_down"][shard]),
                 ("b_gate_up", None if full["b_gate_up"] is None else full["b_gate_up"][shard]),
                 ("b_down", None if full["b_down"] is None else full["b_down"][shard])) if v is not None}
        layer = torch.compile(moe_experts_ep, fullgraph=True) if compiled else moe_experts_ep
        out = layer(mine["x"], full["topk_ids"][lo:hi], mine["topk_weights"], mine["w_gate_up"], mine["w_down"],
                    b_gate_up=mine.get("b_gate_up"), b_down=mine.get("b_down"))
        grads = torch.autograd.grad(out, [mine[k] for k in names], grad_out[lo:hi])
        return out, dict(zip(names, grads))

    out, grads = ep_run()
    out2, grads2 = ep_run()
    tol = 2e-2 if full["x"].dtype == torch.bfloat16 else 1e-5
    problems = []
    if not torch.equal(out, out2) or any(not torch.equal(grads[k], grads2[k]) for k in names):
        problems.append("two runs differ")
    if hi > lo and rel_err(out, ref_out[lo:hi]) > tol:
        problems.append(f"out rel err {rel_err(out, ref_out[lo:hi])}")
    for k in names:
        want = ref_grads[k][lo:hi] if k in ("x", "topk_weights") else ref_grads[k][shard]
        if want.numel() and rel_err(grads[k], want) > tol:
            problems.append(f"grad {k} rel err {rel_err(grads[k], want)}")
    return problems


def _rank_main(rank, port, device, body, args, errors):
    """One rank: joins the process group, runs ``body(rank, device, *args)`` and queues the
    problems it returns (or its traceback)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    if device == "cuda":
        # NVLink multicast stays off on the GPU machines (their notes ask for it).
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("nccl" if device != "cpu" else "gloo", rank=rank, world_size=WORLD)
    try:
        for problem in body(rank, device, *args):
            errors.put(f"rank {rank}: {problem}")
    except Exception:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
    else:
        # Both ranks done before either tears the group down: a collective still in flight
        # on one rank (FSDP's, in the HF case) would otherwise abort the process. On gloo the
        # wait is bounded, so a rank that died fails the test instead of hanging it.
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        else:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _in_ranks(body, *args, device="cpu", seed=None):
    """Runs ``body`` on WORLD processes and fails with every problem they report."""
    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank_main, args=(_free_port(), device, body, args, errors), nprocs=WORLD,
                       start_method="spawn")
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found) + f"\nseed={seed}"


def _all_cases(rank, device, seed):
    # The split sizes are read from the device: under torch.compile they become sizes the
    # graph learns at run time.
    torch._dynamo.config.capture_scalar_outputs = True
    for name in CASES:
        yield from (f"{name}: {p}" for p in _run_case(name, rank, seed, device=device))
    for name in COMPILED_CASES:
        yield from (f"{name} compiled: {p}" for p in _run_case(name, rank, seed, compiled=True, device=device))


def test_all_to_all_matches_one_process_with_every_expert(seed):
    _in_ranks(_all_cases, seed, seed=seed)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")
def test_all_to_all_on_gpus(seed):
    """The same cases on two GPUs over NCCL, the Triton kernels on each: parity with one GPU
    holding every expert, two runs bitwise equal, eager and compiled."""
    _in_ranks(_all_cases, seed, device="cuda", seed=seed)


def _hf_model_parity(rank, device, path, seed):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import moeblaze_ops.hf  # noqa: F401

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed + rank))
    reference = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    want = reference(input_ids=ids, labels=ids)
    config = DistributedConfig(ep_size=WORLD, fsdp_size=WORLD, ep_implementation="moeblaze")
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, experts_implementation="moeblaze")
    got = model(input_ids=ids, labels=ids)
    if rel_err(got.logits, want.logits) > 1e-5:
        yield f"logits rel err {rel_err(got.logits, want.logits)}"
    got.loss.backward()
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    grads = [p.grad for m in experts for p in m.parameters()]
    if not grads or any(g is None or not torch.isfinite(g.full_tensor() if hasattr(g, "full_tensor") else g).all()
                        for g in grads):
        yield "expert weight gradients missing or not finite"


def test_hf_ep_implementation_moeblaze(seed, tmp_path):
    """A tiny Qwen3-MoE through DistributedConfig(ep_size=2, ep_implementation="moeblaze") on
    two gloo processes: each rank's logits equal a one-process eager model's; backward runs."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' distributed loading needs it
    pytest.importorskip("transformers.distributed.expert_parallel")
    import moeblaze_ops.hf

    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(moeblaze_ops.hf.model_config("qwen3_moe", num_layers=1)) \
        .save_pretrained(tmp_path)
    _in_ranks(_hf_model_parity, str(tmp_path), seed, seed=seed)


def test_expert_parallel_benchmark_smoke(tmp_path):
    """``python -m moeblaze_ops.bench.expert_parallel`` on two gloo processes: one row per
    config with finite, positive throughputs, a straggler ratio of at least 1, and the table
    written."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, "-m", "moeblaze_ops.bench.expert_parallel", "--spawn", str(WORLD),
                          "--device", "cpu", "--configs", "smoke", "--reps", "1", "--warmup", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_ep.json").read_text())
    assert [r["config"] for r in rows] == ["smoke"]
    for key in ("single_tokens_per_s", "ep_tokens_per_s", "ep_speedup_vs_single"):
        assert 0 < rows[0][key] < float("inf"), key
    assert rows[0]["straggler_ratio"] >= 1.0 and len(rows[0]["expert_ms_per_rank"]) == WORLD
    assert "| smoke | 2 |" in (tmp_path / "bench_ep.md").read_text()
