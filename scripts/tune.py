"""Sweeps the tile of one GEMM kind at a time (``settings.tiles``) on the benchmark's shapes,
timing the layer with each: the forward (without gradients) for the forward GEMMs ``up``
and ``down``, forward + backward for the others, each beside the default tile: what runs
without an override (a Gluon kernel's own tile where one runs, else the tile table's).

    python scripts/tune.py [--configs olmoe mixtral] [--kinds up down dh dx wgrad_down wgrad_up]
        [--tiles BM,BN,BK,warps,stages[,programs_per_sm] ...] [--rounds 3] [--device cuda|cpu]

Only the kind's tile changes (every other choice is the settings' default), so a row's
time differs from the default's row by what that tile changes. The tiles are timed round
by round, in turn, on the same inputs, so the GPU's clock and power drift lands on each
alike; a row is the median over the rounds, with its speed against the default tile
(above 1: faster). A swept tile equal to the default runs the same kernel: its row
against the default's is the noise of the timing. A tile that cannot run (more shared memory than a block has, a shape
a kernel does not take) prints its error instead of a time. Eager only: a compiled graph
keeps the tiles it was compiled with. ``--device cpu`` (the portable kernels, which take
no tiles) checks the script itself.
"""

import argparse
import statistics

import torch

from moeblaze_ops import moe_experts, settings
from moeblaze_ops.bench import CONFIGS, make_inputs, time_ms

FORWARD_KINDS = ("up", "down")
#: Tiles tried when ``--tiles`` names none (block_m, block_n, block_k, warps, stages).
TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
         (256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (64, 256, 64, 4, 4), (128, 128, 32, 8, 4)]


def parse_tile(text):
    """``BM,BN,BK,warps,stages[,programs_per_sm]`` -> a tuple of ints (an argparse type)."""
    try:
        tile = tuple(int(v) for v in text.split(","))
    except ValueError:
        tile = ()
    if len(tile) not in (5, 6):
        raise argparse.ArgumentTypeError(f"expected BM,BN,BK,warps,stages[,programs_per_sm], got {text!r}")
    return tile


def sweep(config, kinds, tiles, rounds, device):
    """{kind: {label: [ms per round] or the error of its first failure}}, label "default"
    for the tile that runs without an override, else the tile."""
    x, ids, w, w_gate_up, w_down = make_inputs(*CONFIGS[config], device=device)
    params = (x, w, w_gate_up, w_down)
    grad = torch.randn_like(x)

    def forward():
        with torch.no_grad():
            return moe_experts(x, ids, w, w_gate_up, w_down)

    def train():
        moe_experts(x, ids, w, w_gate_up, w_down).backward(grad)

    results = {}
    for kind in kinds:
        is_forward = kind in FORWARD_KINDS
        for t in params:
            t.requires_grad_(not is_forward)
            t.grad = None
        step = forward if is_forward else train
        step()  # first-call costs (autograd's, the allocator's) out of the first round
        for t in params:
            t.grad = None
        variants = {"default": {}, **{",".join(map(str, tile)): {"tiles": {kind: tile}} for tile in tiles}}
        times = results[kind] = {label: [] for label in variants}
        for _ in range(rounds):
            for label, changes in variants.items():
                if not isinstance(times[label], list):
                    continue  # failed in an earlier round
                try:
                    with settings.override(**changes):
                        times[label].append(time_ms(step, device, grad_to_none=() if is_forward else params))
                except Exception as e:  # noqa: BLE001 - out of shared memory, a shape a kernel does not take
                    times[label] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:100]}"
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def report(config, results):
    """A markdown table per config: kind, tile, median ms, speed against the default tile."""
    lines = [f"## {config} {CONFIGS[config]} (T, d, I, E, K)", "", "| kind | tile | ms | vs default |",
             "| --- | --- | --- | --- |"]
    for kind, times in results.items():
        base = statistics.median(times["default"]) if isinstance(times["default"], list) else None
        for label, ms in times.items():
            if not isinstance(ms, list):
                lines.append(f"| {kind} | {label} | failed: {ms} | - |")
                continue
            med = statistics.median(ms)
            lines.append(f"| {kind} | {label} | {med:.3f} | {f'{base / med:.3f}x' if base else '-'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["olmoe", "mixtral"], choices=list(CONFIGS))
    p.add_argument("--kinds", nargs="+", default=["up", "down", "dh", "dx", "wgrad_down", "wgrad_up"],
                   help="GEMM kinds to sweep, one at a time (the names settings.tiles takes)")
    p.add_argument("--tiles", nargs="+", type=parse_tile, default=TILES, metavar="BM,BN,BK,W,S[,P]",
                   help="tiles to try for every kind (default: a few common ones)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU here: --device cpu checks the script")
    try:  # the settings say which kinds and tiles there are
        settings.current().replace(tiles={kind: tile for kind in a.kinds for tile in a.tiles[:1]})
    except ValueError as e:
        p.error(str(e))
    for config in a.configs:
        print(report(config, sweep(config, a.kinds, a.tiles, a.rounds, a.device)) + "\n", flush=True)


if __name__ == "__main__":
    main()
