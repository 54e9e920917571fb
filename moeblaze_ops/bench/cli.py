"""``python -m moeblaze_ops.bench``: moeblaze against its peers, side by side, in one run.

Peers: HF transformers' experts backends ``eager`` (a loop over experts), ``grouped_mm``
and ``grouped_mm`` under ``torch.compile``; moeblaze eager and compiled. Forward mode times
the experts' forward (bf16, SwiGLU, uniform routing) and measures its peak memory above the
inputs; train mode times forward + backward and measures the activation memory kept for
backward (the unique storages autograd saves, parameters and the layer input excluded) and
the peak memory of one step. A dispatch micro-benchmark compares moeblaze's dispatch with
the sort + histc + cumsum that ``grouped_mm`` runs. ``--cudagraphs`` adds ``grouped_mm``
and moeblaze compiled with ``mode="reduce-overhead"`` (time only), and times the dispatch
calls replayed from CUDA graphs too (device time, without the host's launches). Writes
bench.md (tables), bench.json and forward.png (bar charts, with matplotlib) under ``--out``.

``--peer-site DIR`` (repeatable) adds DIR as a site directory (its ``.pth`` files
processed) before the peers are imported: where a peer's wheels were installed with
``pip install --target DIR`` (SonicMoE's CuTe DSL is found through a ``.pth`` file).

``--set NAME=VALUE`` (repeatable) runs every measurement with that field of
``moeblaze_ops.settings.KernelSettings`` changed; VALUE is a Python literal (``None``,
``512``, ``False``) or else a string. A NAME the settings do not have, or a VALUE they
reject, is a usage error (exit code 2) that says which fields there are; so is a name
``--configs`` or ``--skip`` does not know. ``--device cpu --configs smoke`` is a quick
check of the benchmark itself (fp32, no peak memory, no dispatch micro-benchmark).

``python -m moeblaze_ops.bench.expert_parallel`` (under torchrun, or ``--spawn N --device
cpu``) measures expert parallelism against one device.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import site
import time
from pathlib import Path

import torch

from .. import settings
from .configs import CONFIGS
from .console import note
from .implementations import PEER_NAMES
from .measure import BenchContext, bench_dispatch, bench_forward, bench_train
from .report import dispatch_table, forward_table, plot, title, train_table

__all__ = ["add_peer_sites", "main", "parse_setting", "setting_changes"]


def parse_setting(text):
    """``NAME=VALUE`` -> (NAME, VALUE), VALUE read as a Python literal or else kept as a string;
    an argparse type, so a malformed item is a usage error (the names are checked by the
    settings themselves: ``setting_changes``)."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    return name, value


def _parser():
    p = argparse.ArgumentParser(prog="python -m moeblaze_ops.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["forward", "train"], default="forward",
                   help="forward: the experts' forward; train: forward + backward, activation and peak memory")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--set", dest="settings", metavar="NAME=VALUE", action="append", type=parse_setting, default=[],
                   help="change a kernel setting for the whole run (repeatable), e.g. --set column_slab=None")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS),
                   help="layer shapes to measure (none: the dispatch micro-benchmark alone)")
    p.add_argument("--skip", nargs="*", default=[], choices=PEER_NAMES, metavar="PEER",
                   help=f"peers to leave out, of: {', '.join(PEER_NAMES)}")
    p.add_argument("--no-dispatch", action="store_true", help="skip the dispatch micro-benchmark")
    p.add_argument("--cudagraphs", action="store_true",
                   help="add grouped_mm and moeblaze compiled with mode='reduce-overhead' (CUDA graphs; "
                        "time only: their memory is the graphs' pool), and dispatch timed from CUDA graphs")
    p.add_argument("--peer-site", metavar="DIR", action="append", default=[],
                   help="a site directory holding peers' packages, e.g. one that pip --target installed "
                        "SonicMoE into (repeatable)")
    p.add_argument("--out", default="bench_out")
    return p


def setting_changes(parser, items):
    """``{NAME: VALUE}`` of the ``--set`` items (``parse_setting``'s pairs; a later one wins),
    checked by ``KernelSettings`` itself: a name it does not have or a value it rejects is
    ``parser``'s usage error, with the settings' own message (which lists the fields)."""
    changes = dict(items)
    try:
        settings.current().replace(**changes)
    except (ValueError, TypeError) as e:
        parser.error(f"--set: {e}")
    return changes


def _jsonable(value):
    """JSON form of a setting value json cannot write itself (sets, tiles)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return repr(value)


def _versions():
    """Versions of the peers' libraries that are importable."""
    found = {}
    for name in ("transformers", "triton"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            pass
    return found


def _measure(args, ctx, changes):
    """Runs the measurements (under the settings in force) -> (bench.json's dict, bench.md's lines)."""
    device_name = torch.cuda.get_device_name() if ctx.on_cuda else "CPU"
    result = dict(device=device_name, torch=torch.__version__, mode=args.mode, settings=changes, **_versions())
    text = [title(args.mode, device_name, torch.__version__, changes)]
    if not args.no_dispatch:
        if ctx.on_cuda:
            result["dispatch"] = bench_dispatch(ctx)
            text += ["", "## dispatch", "", dispatch_table(result["dispatch"])]
            print("\n".join(text[-3:]), flush=True)
        else:
            note(f"bench: dispatch micro-benchmark left out on {ctx.device} (it times CUDA kernels)")
    if args.mode == "forward":
        result["forward"] = bench_forward(ctx, args.configs)
        dtype = "bf16" if ctx.on_cuda else "fp32"  # make_inputs' default dtype
        text += ["", f"## forward ({dtype}, SwiGLU, uniform routing)", "", forward_table(result["forward"])]
    else:
        result["train"] = bench_train(ctx, args.configs)
        text += ["", "## forward + backward (SwiGLU, uniform routing)", "", train_table(result["train"])]
    return result, text


def add_peer_sites(parser, directories):
    """Adds each of ``directories`` (``--peer-site``) as a site directory, reading its
    ``.pth`` files; a missing one is ``parser``'s error."""
    for directory in directories:
        if not Path(directory).is_dir():
            parser.error(f"--peer-site: no directory {directory!r}")
        site.addsitedir(directory)


def main(argv=None):
    """Runs the benchmark with command-line arguments ``argv`` (``sys.argv[1:]`` by default)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: --device cpu runs the smoke check")
    changes = setting_changes(parser, args.settings)
    add_peer_sites(parser, args.peer_site)
    if args.cudagraphs and args.device != "cuda":
        parser.error("--cudagraphs needs --device cuda")
    ctx = BenchContext(device=args.device, skip=frozenset(args.skip), cuda_graphs=args.cudagraphs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # The override also tags torch.compile's caches with the settings (settings.override),
    # so compiled peers never load a graph compiled under other settings.
    with settings.override(**changes):
        result, text = _measure(args, ctx, changes)
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=_jsonable))
    (out / "bench.md").write_text("\n".join(text) + "\n")
    if args.mode == "forward" and result["forward"]:  # `--configs` alone: the dispatch rows only
        if not plot(result["forward"], out / "forward.png"):
            note("bench: forward.png not written (matplotlib is not importable)")
    print("\n".join(text), flush=True)
    print(f"\n({time.time() - t0:.0f} s)")
