"""Time per token of training steps run back to back for seconds, as a training loop runs
them, with the GPU's SM clock, power and temperature over the run; moeblaze beside its
peers, each stepping on its own in turn.

    python scripts/sustained_step.py [--configs mixtral] [--tokens 16384 65536] [--seconds 20]
        [--peers moeblaze hf_grouped_mm_compiled] [--rounds 2] [--peer-site DIR] [--device cuda|cpu]

The benchmark times a few steps after a short warm-up: at its own sizes that is mostly
before the GPU has reached its power limit, where the clocks are higher. A step of many
tokens is long enough to reach it within the timing, so its time per token looks worse
than a short step's even where the kernels scale perfectly; and a peer that draws less
power for its work gains at the limit. Here each (config, T) steps forward + backward of
each peer's layer (the benchmark's peers, ``--peers``; from no gradients) for
``--seconds``, the peers in turn, ``--rounds`` times (the order the same each round: a
peer's phase in the first round starts cooler than in the later ones), each step timed
by CUDA events; ``nvidia-smi`` samples the clock, power and temperature every 250 ms, and
the last three quarters of the samples (the settled part) are averaged. One row per phase:

    | config | T | peer | round | steps | first ms | median ms | us per token | SM MHz | W | C |

``--peer-site DIR`` finds a peer installed there (SonicMoE: ``scripts/sonicmoe_peer.sh``).
On the CPU (``--device cpu``, for a check of the script) nothing is sampled.
"""

import argparse
import shutil
import subprocess
import time

import torch

from moeblaze_ops.bench import CONFIGS, make_inputs, peers
from moeblaze_ops.bench.cli import add_peer_sites, positive_int
from moeblaze_ops.bench.implementations import PEER_NAMES, train_step

SAMPLES = ["clocks.sm", "power.draw", "temperature.gpu"]


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["mixtral"], choices=list(CONFIGS))
    p.add_argument("--tokens", nargs="+", type=positive_int, default=None, metavar="T",
                   help="the phases' token counts, in order (default: each config's own T)")
    p.add_argument("--seconds", type=float, default=20.0, help="how long each phase steps")
    p.add_argument("--peers", nargs="+", default=["moeblaze"], choices=PEER_NAMES, metavar="PEER",
                   help=f"of: {', '.join(PEER_NAMES)} (default: moeblaze)")
    p.add_argument("--rounds", type=positive_int, default=1, help="times each peer steps, the peers in turn")
    p.add_argument("--peer-site", metavar="DIR", action="append", default=[],
                   help="a site directory a peer is installed into (SonicMoE: see scripts/sonicmoe_peer.sh)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return p


def settled_means(lines):
    """The mean of each sampled quantity over the last three quarters of ``nvidia-smi``'s
    csv ``lines`` (the first quarter: the clocks still settling), lines it could not read
    ("[N/A]") left out; None without a readable line."""
    rows = []
    for line in lines:
        try:
            values = [float(v) for v in line.split(",")]
        except ValueError:
            continue
        if len(values) == len(SAMPLES):
            rows.append(values)
    rows = rows[len(rows) // 4:]
    return [sum(column) / len(column) for column in zip(*rows)] if rows else None


class Sampler:
    """``nvidia-smi`` sampling the clock, power and temperature every 250 ms from when it is
    made; ``settled()`` stops it and returns ``settled_means`` (None on the CPU or without
    ``nvidia-smi``)."""

    def __init__(self, device):
        self.proc = None
        if device == "cuda" and shutil.which("nvidia-smi"):
            index = torch.cuda.current_device()
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(SAMPLES)}", "--format=csv,noheader,nounits",
                 "-lms", "250"], stdout=subprocess.PIPE, text=True)

    def settled(self):
        if self.proc is None:
            return None
        self.proc.terminate()
        return settled_means(self.proc.stdout.read().splitlines())


def phase(fn, params, grad, seconds, device):
    """Steps ``fn`` (a peer's forward; backward of ``grad`` through it, from no gradients
    of ``params``) for ``seconds``; returns the steps' count, first and median ms and the
    settled samples."""
    cuda = device == "cuda"

    def step():
        for t in params:
            t.grad = None
        train_step(fn, grad)

    step()  # a compiled peer compiles outside the timing
    if cuda:
        torch.cuda.synchronize()
    sampler = Sampler(device)
    times, start = [], time.perf_counter()
    while not times or time.perf_counter() - start < seconds:
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return dict(steps=len(times), first_ms=times[0], median_ms=sorted(times)[len(times) // 2],
                settled=sampler.settled())


def cases(a):
    """Rows, phase by phase: per config and T, each peer in turn, ``--rounds`` times."""
    for name in a.configs:
        for T in a.tokens or [CONFIGS[name][0]]:
            _, d, I, E, K = CONFIGS[name]
            torch._dynamo.reset()
            x, ids, w, w_gate_up, w_down = make_inputs(T, d, I, E, K, device=a.device)
            params = (x, w, w_gate_up, w_down)
            for t in params:
                t.requires_grad_(True)
            grad = torch.randn_like(x)
            fns = peers(x, ids, w, w_gate_up, w_down, train=True)
            missing = [peer for peer in a.peers if peer not in fns]
            if missing:
                raise SystemExit(f"sustained_step.py: not available here: {', '.join(missing)} "
                                 f"(peers: {', '.join(fns)})")
            for round_ in range(1, a.rounds + 1):
                for peer in a.peers:
                    r = phase(fns[peer], params, grad, a.seconds, a.device)
                    yield dict(config=name, T=T, peer=peer, round=round_, us_per_token=r["median_ms"] / T * 1e3, **r)
            del fns, x, ids, w, w_gate_up, w_down, params, grad
            if a.device == "cuda":
                torch.cuda.empty_cache()


def row(r):
    clock, power, temp = (f"{v:.0f}" for v in r["settled"]) if r["settled"] else ("-", "-", "-")
    return (f"| {r['config']} | {r['T']} | {r['peer']} | {r['round']} | {r['steps']} | {r['first_ms']:.1f} | "
            f"{r['median_ms']:.1f} | {r['us_per_token']:.3f} | {clock} | {power} | {temp} |")


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU here: --device cpu")
    if not a.seconds > 0:
        p.error(f"--seconds must be positive, got {a.seconds}")
    add_peer_sites(p, a.peer_site)
    print("| config | T | peer | round | steps | first ms | median ms | us per token | SM MHz | W | C |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    rows = []
    for r in cases(a):
        rows.append(r)
        print(row(r), flush=True)
    return rows


if __name__ == "__main__":
    main()
