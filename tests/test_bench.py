"""The benchmark's own smoke runs on CPU: what it measures, records and writes; and the
measuring scripts' helpers that need no GPU."""

import argparse
import csv
import json
import math

import pytest

from moeblaze_ops import settings
from moeblaze_ops.bench import CONFIGS, cli, main, measure


def run(tmp_path, *args):
    """Runs the benchmark on CPU with ``args``; returns (bench.json's dict, bench.md's text)."""
    main(["--device", "cpu", "--out", str(tmp_path), *args])
    return json.loads((tmp_path / "bench.json").read_text()), (tmp_path / "bench.md").read_text()


def table_rows(markdown, config):
    """peer -> cells of each markdown table row of ``config``."""
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith(f"| {config} |")]
    return {cells[1].strip(): [c.strip() for c in cells] for cells in rows}


def assert_timed(rows):
    for r in rows:
        assert math.isfinite(r["ms"]) and r["ms"] > 0, r
        assert math.isfinite(r["tflops"]) and r["tflops"] > 0, r


def test_forward_smoke_rows_agree_with_hf(tmp_path):
    result, md = run(tmp_path, "--configs", "smoke", "--skip", "hf_grouped_mm_compiled")
    rows = {r["peer"]: r for r in result["forward"]}
    # hf_eager first: the reference the others are compared with
    assert list(rows) == ["hf_eager", "hf_grouped_mm", "moeblaze", "moeblaze_compiled"]
    assert all(r["config"] == "smoke" for r in rows.values())
    assert_timed(rows.values())
    assert rows["hf_eager"]["rel_diff_vs_first"] == 0
    for peer in ("hf_grouped_mm", "moeblaze", "moeblaze_compiled"):
        assert rows[peer]["rel_diff_vs_first"] < 1e-3, peer
    assert all(math.isnan(r["peak_gb"]) and math.isnan(r["train_fwd_peak_gb"]) for r in rows.values())
    table = table_rows(md, "smoke")
    assert set(table) == set(rows)
    assert table["moeblaze"][2] == f"{rows['moeblaze']['ms']:.3f}"
    assert "## forward (fp32, SwiGLU, uniform routing)" in md


def test_train_smoke_measures_what_backward_keeps(tmp_path):
    """Activation memory is exact on CPU; the compiled recompute peer is the one compiled peer here."""
    result, md = run(tmp_path, "--mode", "train", "--configs", "smoke",
                     "--skip", "hf_eager", "hf_grouped_mm_compiled", "moeblaze_compiled")
    rows = {r["peer"]: r for r in result["train"]}
    assert set(rows) == {"hf_grouped_mm", "moeblaze", "moeblaze_recompute", "moeblaze_recompute_compiled"}
    assert_timed(rows.values())
    T, d, I, E, K = CONFIGS["smoke"]
    LK, f32, i32 = T * K, 4, 4
    # h, expert_token_indices, expert_offsets, token_index_map, topk_weights: nothing else.
    expected = LK * 2 * I * f32 + LK * i32 + (E + 1) * i32 + LK * i32 + T * K * f32
    assert rows["moeblaze"]["activation_bytes"] == expected
    assert rows["hf_grouped_mm"]["activation_bytes"] > expected
    # Full recompute: the index arrays and topk_weights only.
    assert rows["moeblaze_recompute"]["activation_bytes"] == expected - LK * 2 * I * f32
    # ... under torch.compile (Inductor) too: the compiled forward hands backward no h.
    assert rows["moeblaze_recompute_compiled"]["activation_bytes"] == expected - LK * 2 * I * f32
    table = table_rows(md, "smoke")
    assert set(table) == set(rows)
    assert table["moeblaze"][4] == f"{expected / 1e9:.3f}"  # the activation GB column


def test_settings_are_in_force_and_recorded(tmp_path, monkeypatch):
    """--set and --torch-backward change the settings the measurements run under, and the
    run records them (no configs: nothing is measured)."""
    seen = []
    monkeypatch.setattr(cli, "bench_forward", lambda ctx, names: seen.append(settings.current()) or [])
    result, md = run(tmp_path, "--configs", "--torch-backward", "--set", "column_slab=None",
                     "--set", "dispatch_sort_chunk=256")
    assert seen[0].column_slab is None and seen[0].dispatch_sort_chunk == 256 and not seen[0].triton_backward
    assert settings.current().column_slab is not None  # only for the run
    assert result["settings"] == {"triton_backward": False, "column_slab": None, "dispatch_sort_chunk": 256}
    assert result["triton_backward"] is False and result["forward"] == []
    assert md.splitlines()[0].endswith("settings triton_backward=False, column_slab=None, dispatch_sort_chunk=256")
    assert table_rows(md, "smoke") == {}
    assert not (tmp_path / "forward.png").exists()  # no forward rows: nothing to plot


def test_a_peer_that_cannot_run_on_cpu_is_left_out_with_a_note(tmp_path, monkeypatch, capsys):
    def two_peers(x, ids, w, w_gate_up, w_down, train=False, cuda_graphs=False):
        def broken():
            raise NotImplementedError("no CPU kernel\nsecond line")

        return {"working": lambda: x * 2, "broken": broken}

    monkeypatch.setattr(measure, "peers", two_peers)
    result, md = run(tmp_path, "--configs", "smoke", "--no-dispatch")
    assert [r["peer"] for r in result["forward"]] == ["working"]
    notes = [line for line in capsys.readouterr().err.splitlines() if "broken" in line]
    assert notes == ["bench: broken left out on cpu: NotImplementedError: no CPU kernel"]
    assert set(table_rows(md, "smoke")) == {"working"}


@pytest.mark.parametrize("item", ["no_such_setting=1", "column_slab", "dispatch_sort_chunk=100", "gluon={'wgrad'}",
                                  "wgrad_band=0", "wgrad_rows_tma={'up'}"])
def test_bad_setting_is_a_usage_error(tmp_path, item, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cpu", "--configs", "--out", str(tmp_path), "--set", item])
    assert exit_.value.code == 2
    assert "--set" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


def test_peer_site_makes_its_packages_importable(tmp_path, monkeypatch):
    """``--peer-site`` processes the directory's .pth files, as SonicMoE's CuTe DSL needs."""
    import importlib
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    peer_site, package_root = tmp_path / "site", tmp_path / "elsewhere"
    peer_site.mkdir()
    package_root.mkdir()
    (package_root / "moeblaze_fake_peer.py").write_text("ANSWER = 42\n")
    (peer_site / "fake_peer.pth").write_text(f"{package_root}\n")
    with pytest.raises(ImportError):
        importlib.import_module("moeblaze_fake_peer")
    run(tmp_path / "out", "--configs", "--peer-site", str(peer_site))
    assert importlib.import_module("moeblaze_fake_peer").ANSWER == 42
    sys.modules.pop("moeblaze_fake_peer")


def test_missing_peer_site_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cpu", "--configs", "--out", str(tmp_path), "--peer-site", str(tmp_path / "none")])
    assert exit_.value.code == 2
    assert "--peer-site" in capsys.readouterr().err


def test_cuda_graph_peers_are_timed_without_memory_columns():
    """The reduce-overhead peers run (on CPU, Inductor compiles them without graphs), agree
    with the reference, and leave the memory columns unmeasured ("-"), since a graph's
    memory is its pool's, allocated once."""
    from moeblaze_ops.bench import report
    from moeblaze_ops.bench.implementations import CUDA_GRAPH_PEERS

    ctx = measure.BenchContext(device="cpu", skip=frozenset({"hf_eager", "hf_grouped_mm", "moeblaze_compiled"}),
                               cuda_graphs=True)
    rows = {r["peer"]: r for r in measure.bench_forward(ctx, ["smoke"])}
    assert set(CUDA_GRAPH_PEERS) <= set(rows)
    assert_timed(rows.values())
    for peer in CUDA_GRAPH_PEERS:
        assert rows[peer]["rel_diff_vs_first"] < 1e-3, peer
        assert math.isnan(rows[peer]["peak_gb"]) and math.isnan(rows[peer]["train_fwd_peak_gb"])
    table = table_rows(report.forward_table(list(rows.values())), "smoke")
    assert table["moeblaze_cudagraphs"][4:6] == ["-", "-"]
    rows = {r["peer"]: r for r in measure.bench_train(ctx, ["smoke"])}
    assert set(CUDA_GRAPH_PEERS) <= set(rows)
    assert_timed(rows.values())
    assert all(math.isnan(rows[peer]["activation_gb"]) for peer in CUDA_GRAPH_PEERS)


def test_dispatch_table_shows_graph_times_where_measured():
    """The dispatch rows' CUDA-graph columns (``--cudagraphs``) appear only where the rows
    have them, each speedup beside its own times."""
    from moeblaze_ops.bench.report import dispatch_table

    row = dict(L=64, K=2, E=8, sort_histc_cumsum_ms=0.3, moeblaze_kernels_ms=0.1, moeblaze_op_ms=0.15,
               speedup_kernels=3.0, speedup_op=2.0)
    graphed = dict(row, sort_histc_cumsum_graph_ms=0.2, moeblaze_kernels_graph_ms=0.04, moeblaze_op_graph_ms=0.05,
                   speedup_kernels_graph=5.0, speedup_op_graph=4.0)
    plain = table_rows(dispatch_table([row]), "64")["2"]
    assert plain[-1] == "3.0x / 2.0x" and len(plain) == 7
    cells = table_rows(dispatch_table([graphed]), "64")["2"]
    assert cells[3:7] == ["0.300", "0.100", "0.150", "3.0x / 2.0x"]
    assert cells[7:] == ["0.200", "0.040", "0.050", "5.0x / 4.0x"]


def test_dispatch_call_a_graph_cannot_capture_is_nan_with_a_note(monkeypatch, capsys):
    """With ``cuda_graphs``, a dispatch call whose capture fails reads nan in its columns
    (and speedups) and says why, instead of stopping the run."""
    monkeypatch.setattr(measure, "DISPATCH_CASES", [(16, 2, 4)])
    monkeypatch.setattr(measure, "time_ms", lambda fn, device: 0.5)

    def graph_time_ms(fn):
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    monkeypatch.setattr(measure, "graph_time_ms", graph_time_ms)
    ctx = measure.BenchContext(device="cpu", skip=frozenset(), cuda_graphs=True)
    (row,) = measure.bench_dispatch(ctx)
    assert row["moeblaze_op_ms"] == 0.5 and row["speedup_op"] == 1.0
    assert all(math.isnan(row[k]) for k in ("sort_histc_cumsum_graph_ms", "moeblaze_op_graph_ms", "speedup_op_graph"))
    notes = [line for line in capsys.readouterr().err.splitlines() if "CUDA graph" in line]
    assert len(notes) == 3 and notes[0].endswith("RuntimeError: operation not permitted when stream is capturing")


def test_cuda_graph_peers_need_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--cudagraphs", "--out", str(tmp_path)])
    assert "--cudagraphs needs --device cuda" in capsys.readouterr().err


def test_train_steps_start_without_gradients():
    """``time_ms(grad_to_none=...)`` sets each ``.grad`` to None before every call (a step
    after ``zero_grad(set_to_none=True)``), so no step adds into the last step's gradient."""
    import torch

    t = torch.zeros(2, requires_grad=True)
    seen = []

    def step():
        seen.append(t.grad is None)
        t.grad = torch.ones(2)

    measure.time_ms(step, "cpu", grad_to_none=(t,))
    assert len(seen) >= 2 and all(seen)


def _script(name):
    """``scripts/<name>.py`` as a module."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("T,K,E", [(8192, 8, 256), (100, 4, 16), (7, 2, 8)])
def test_tile_padding_balanced_routing(T, K, E):
    """``scripts/tile_padding.py``'s balanced routing gives every expert the same number of
    rows (where E divides T*K), K distinct experts per token, ids in range."""
    import torch

    ids = _script("tile_padding").balanced_ids(T, K, E, device="cpu")
    assert ids.shape == (T, K) and int(ids.min()) >= 0 and int(ids.max()) < E
    assert all(len(set(row)) == K for row in ids.tolist())
    counts = torch.bincount(ids.flatten(), minlength=E)
    if (T * K) % E == 0:
        assert counts.eq(T * K // E).all()
    else:
        assert int(counts.max() - counts.min()) <= 1


def test_stall_regions_splits_a_warp_specialised_kernel(tmp_path):
    """``scripts/stall_regions.py`` reads ncu's source-page CSV and sums the samples of the
    copy warps, the MMA warps' setup, reduction steps and epilogue, and the rest, by the
    SASS markers that bound them; a share is of all samples, a reason's of its region's."""
    regions = _script("stall_regions")
    code = [("LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]", 30, {"long_sb": 30}),
            ("@!P0 EXIT", 2, {"wait": 2}),
            ("IMAD R3, R4, R5, RZ", 4, {"selected": 4}),
            ("BAR.SYNC.DEFER_BLOCKING 0x0, 0x100", 4, {"barrier": 4}),
            ("SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R23+URZ+0x38290], R22", 10, {"wait": 10}),
            ("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24", 20, {"math": 5, "wait": 15}),
            ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 5, {"wait": 5}),
            ("FMUL R1, R2, R3", 10, {"short_sb": 6, "selected": 4}),
            ("@P1 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R204+URZ+0x382d0], RZ", 5, {"barrier": 5}),
            ("@!P0 BRA 0x7fd6737db770", 10, {"long_sb": 10})]
    reasons = ["barrier", "long_sb", "math", "selected", "short_sb", "wait"]
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "_dh_kernel", ""])
        writer.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)"] + [f"stall_{r}" for r in reasons]
                        + [f"stall_{r} (Not Issued)" for r in reasons])
        for i, (source, samples, split) in enumerate(code):
            writer.writerow([hex(0x1000 + 16 * i), "  " + source, samples] + [split.get(r, 0) for r in reasons]
                            + [0] * len(reasons))
    lines = regions.read_source_csv(str(path))
    assert [(r.name, r.start, r.end) for r in regions.regions(lines)] == [
        ("copy warps", 0, 2), ("MMA warps before their loop", 2, 3), ("MMA warps: reduction steps", 3, 6),
        ("MMA warps: epilogue", 6, 9), ("rest (exit, wait retries)", 9, 10)]
    shares = [row.split(";")[0].split()[-3] for row in regions.summarize(lines, top=2)]
    assert shares == ["32.0%", "4.0%", "34.0%", "20.0%", "10.0%"]
    assert regions.summarize(lines, top=2)[2].endswith("of samples; wait 74%, math 15%")
    assert regions.epilogue_opcodes(lines).startswith("FMUL 50.0% (1), WARPGROUP 25.0% (1), SYNCS 25.0% (1)")


def test_ab_step_times_each_variant_under_its_own_settings(monkeypatch):
    """``scripts/ab_step.py`` interleaves the variants round by round, each timed (and its
    peak measured) with its settings in force and the defaults back afterwards; the
    report's ratio is the first variant's median over each one's. The forward mode runs
    without gradients."""

    ab = _script("ab_step")
    seen, grad_modes = [], []

    def fake_time_ms(fn, device, grad_to_none=()):
        fn()  # a real step, so the inputs and the op are exercised
        band = settings.current().row_band
        seen.append(band)
        return float(band)

    def fake_peak_bytes(fn, device):
        out = fn()
        grad_modes.append(out is not None and out.requires_grad)
        return settings.current().row_band * 1e9

    monkeypatch.setattr(ab, "time_ms", fake_time_ms)
    monkeypatch.setattr(ab, "peak_bytes", fake_peak_bytes)
    default_band = settings.current().row_band
    variants = [ab.parse_variant(v) for v in ("row_band=2", "row_band=8 wgrad_band=3")]
    results, peaks = ab.run(["smoke"], variants, rounds=3, device="cpu")
    assert seen == [2, 8] * 3 and settings.current().row_band == default_band
    assert results == {"smoke": {0: [2.0] * 3, 1: [8.0] * 3}}
    assert peaks == {"smoke": {0: 2.0, 1: 8.0}}
    table = ab.report(results, peaks, ["row_band=2", "row_band=8 wgrad_band=3"])
    assert table.splitlines()[-1].endswith("| 8.00 | 0.250x | 8.000 |")
    seen.clear()
    ab.run(["smoke"], variants[:1], rounds=1, device="cpu", mode="forward")
    assert seen == [2] and grad_modes[-1] is False  # the forward's output carries no graph
    with pytest.raises(argparse.ArgumentTypeError):
        ab.parse_variant("no_such_setting=1")


def test_cuda_graph_peers_train_from_no_gradients(monkeypatch):
    """A replayed graph's gradients are its outputs, overwritten by its next replay, so every
    step of a CUDA-graph peer (the warm-up steps of ``triton.testing.do_bench``, which clear
    no gradients, included) must start from none; the other peers keep the timer's clearing."""
    seen = {"moeblaze_cudagraphs": [], "plain": []}

    def two_peers(x, ids, w, w_gate_up, w_down, train=False, cuda_graphs=False):
        def peer(name):
            def call():
                seen[name].append(any(t.grad is not None for t in (x, w, w_gate_up, w_down)))
                return (x * w_gate_up.sum() + w_down.sum() + w.sum()).float()
            return call

        return {name: peer(name) for name in seen}

    def warm_up_like_do_bench(fn, device, reps_ms=200, grad_to_none=()):
        for _ in range(3):  # warm-up calls: gradients accumulate
            fn()
        return 1.0

    monkeypatch.setattr(measure, "peers", two_peers)
    monkeypatch.setattr(measure, "time_ms", warm_up_like_do_bench)
    monkeypatch.setattr(measure, "peak_bytes", lambda fn, device: 0)
    monkeypatch.setattr(measure, "activation_bytes", lambda fn, exclude: (None, 0))
    ctx = measure.BenchContext(device="cpu", skip=frozenset(), cuda_graphs=True)
    measure.bench_train(ctx, ["smoke"])
    assert seen["moeblaze_cudagraphs"][:4] == [False] * 4
    assert seen["plain"][1:4] == [True] * 3  # the stand-in timer does accumulate
