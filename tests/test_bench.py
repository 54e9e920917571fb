"""The benchmark's own smoke runs on CPU: what it measures, records and writes, and its
command line's errors (the tools in scripts/: test_scripts.py)."""

import json
import math
import time

import pytest
import torch

from moeblaze_ops import settings
from moeblaze_ops.bench import CONFIGS, cli, main, make_inputs, measure
from moeblaze_ops.bench.configs import DECODE_TOKENS, load_imbalance
from moeblaze_ops.bench.implementations import PEER_NAMES
from moeblaze_ops.testing import rel_err


def run(tmp_path, *args):
    """Runs the benchmark on CPU with ``args``; returns (bench.json's dict, bench.md's text)."""
    main(["--device", "cpu", "--out", str(tmp_path), *args])
    return json.loads((tmp_path / "bench.json").read_text()), (tmp_path / "bench.md").read_text()


def table_rows(markdown, config, key=3):
    """cells[key] (the peer's, after config, T and max/mean load) -> cells of each markdown
    table row of ``config``."""
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith(f"| {config} |")]
    return {cells[key].strip(): [c.strip() for c in cells] for cells in rows}


def only(*kept):
    """``--skip`` of every peer but ``kept``: quick runs, nothing compiled unless kept."""
    return ["--skip", *(name for name in PEER_NAMES if name not in kept)]


def bincount_imbalance(ids, E):
    """The busiest expert's routed rows over the mean, counted here by ``torch.bincount``."""
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert counts.numel() == E and int(counts.sum()) == ids.numel()
    return float(counts.max()) / float(counts.double().mean())


#: make_inputs' routing arguments and their defaults (uniform routing).
UNIFORM = dict(tilt=0.0, hot=0.0, empty=0)


@pytest.fixture
def drawn(monkeypatch):
    """The (T, routing, ids) of every ``make_inputs`` call the measurements make, routing the
    dict of its ``tilt``, ``hot`` and ``empty`` (``UNIFORM``'s keys)."""
    seen = []

    def make_inputs_spy(T, d, I, E, K, **kwargs):
        inputs = make_inputs(T, d, I, E, K, **kwargs)
        seen.append((T, {key: kwargs.get(key, default) for key, default in UNIFORM.items()}, inputs[1].clone()))
        return inputs

    monkeypatch.setattr(measure, "make_inputs", make_inputs_spy)
    return seen


def assert_timed(rows):
    for r in rows:
        assert math.isfinite(r["ms"]) and r["ms"] > 0, r
        assert math.isfinite(r["tflops"]) and r["tflops"] > 0, r


def test_forward_smoke_rows_agree_with_hf(tmp_path):
    result, md = run(tmp_path, "--configs", "smoke", "--skip", "hf_grouped_mm_compiled")
    rows = {r["peer"]: r for r in result["forward"]}
    # hf_eager first: the reference the others are compared with
    assert list(rows) == ["hf_eager", "hf_grouped_mm", "moeblaze", "moeblaze_compiled"]
    assert all(r["config"] == "smoke" and r["T"] == CONFIGS["smoke"][0] and r["tilt"] == 0 for r in rows.values())
    assert result["tilt"] == 0 and result["tokens"] is None
    assert_timed(rows.values())
    assert rows["hf_eager"]["rel_diff_vs_first"] == 0
    for peer in ("hf_grouped_mm", "moeblaze", "moeblaze_compiled"):
        assert rows[peer]["rel_diff_vs_first"] < 1e-3, peer
    assert all(math.isnan(r["peak_gb"]) and math.isnan(r["train_fwd_peak_gb"]) for r in rows.values())
    table = table_rows(md, "smoke")
    assert set(table) == set(rows)
    assert table["moeblaze"][1:5] == ["512", f"{rows['moeblaze']['load_imbalance']:.2f}x", "moeblaze",
                                      f"{rows['moeblaze']['ms']:.3f}"]
    assert "## forward (fp32, SwiGLU, uniform routing)" in md


def test_train_smoke_measures_what_backward_keeps(tmp_path):
    """Activation memory is exact on CPU; the compiled recompute peer is the one compiled peer here."""
    result, md = run(tmp_path, "--mode", "train", "--configs", "smoke",
                     "--skip", "hf_eager", "hf_grouped_mm_compiled", "moeblaze_compiled", "moeblaze_compiled_autograd")
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
    assert table["moeblaze"][6] == f"{expected / 1e9:.3f}"  # the activation GB column
    # Peaks, from no gradients and accumulating, are CUDA's allocator's: not measured here.
    assert all(math.isnan(r["peak_gb"]) and math.isnan(r["accumulate_peak_gb"]) for r in rows.values())
    assert all(cells[-1] == "-" for cells in table.values())


def test_settings_are_in_force_and_recorded(tmp_path, monkeypatch):
    """--set changes the settings the measurements run under, and the run records them (no
    configs: nothing is measured); bench.json records the changes alone, no other field."""
    seen = []
    monkeypatch.setattr(cli, "bench_forward", lambda ctx, names: seen.append(settings.current()) or [])
    result, md = run(tmp_path, "--configs", "--set", "column_slab=None", "--set", "poison=True")
    assert seen[0].column_slab is None and seen[0].poison is True
    assert settings.current().column_slab is not None  # only for the run
    assert result["settings"] == {"column_slab": None, "poison": True}
    assert "triton_backward" not in result and result["forward"] == []
    assert md.splitlines()[0].endswith("settings column_slab=None, poison=True")
    assert table_rows(md, "smoke") == {}
    assert not (tmp_path / "forward.png").exists()  # no forward rows: nothing to plot


def usage_error(tmp_path, capsys, *args):
    """Runs the benchmark with ``args``, which must stop with argparse's usage error before
    measuring anything; returns the message."""
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cpu", "--out", str(tmp_path), *args])
    assert exit_.value.code == 2
    assert not (tmp_path / "bench.json").exists()
    return capsys.readouterr().err


def test_torch_backward_flag_is_gone(tmp_path, capsys):
    """The PyTorch backward is no setting any more: the flag that chose it is unknown."""
    assert "unrecognized arguments: --torch-backward" in usage_error(tmp_path, capsys, "--configs",
                                                                      "--torch-backward")


@pytest.mark.parametrize("flag,bad,allowed", [
    ("--skip", "bogus", "moeblaze_compiled"),
    ("--configs", "bogus", "olmoe"),
    ("--mode", "bogus", "train"),
    ("--device", "gpu", "cuda"),
])
def test_unknown_choice_is_a_usage_error(tmp_path, capsys, flag, bad, allowed):
    """A name a choice list does not know stops the run, naming it and the names allowed
    (``--skip bogus`` used to measure every peer and exit 0)."""
    err = usage_error(tmp_path, capsys, *(["--configs"] if flag != "--configs" else []), flag, bad)
    assert f"argument {flag}: invalid choice: {bad!r}" in err and repr(allowed) in err, err


def test_skip_names_every_peer():
    """``--skip`` takes every peer the benchmark may offer (``PEER_NAMES``), in their order."""
    from moeblaze_ops.bench import make_inputs, peers
    from moeblaze_ops.bench.implementations import PEER_NAMES

    offered = list(peers(*make_inputs(*CONFIGS["smoke"], device="cpu"), train=True, cuda_graphs=True))
    assert set(offered) <= set(PEER_NAMES)
    assert offered == [name for name in PEER_NAMES if name in offered]
    assert {"hf_eager", "moeblaze", "moeblaze_compiled", "moeblaze_recompute"} <= set(offered)


def test_skip_bogus_fails_on_the_command_line(tmp_path):
    """The command a user types: exit code 2, the bad name and the allowed ones, no traceback."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "moeblaze_ops.bench", "--device", "cpu", "--configs",
                           "--out", str(tmp_path), "--skip", "bogus"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "invalid choice: 'bogus'" in proc.stderr and "'hf_eager'" in proc.stderr
    assert "Traceback" not in proc.stderr


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


@pytest.mark.parametrize("item", ["no_such_setting=1", "column_slab", "=1", "column_slab=0", "backend='cuda'",
                                  "tiles={'no_such_kind': (16, 16, 16, 4, 1)}", "tiles=5"])
def test_bad_setting_is_a_usage_error(tmp_path, item, capsys):
    assert "--set" in usage_error(tmp_path, capsys, "--configs", "--set", item)


def test_unknown_setting_names_are_all_named_with_the_fields(tmp_path, capsys):
    """Every unknown name of the run's ``--set`` items in one message, with the fields the
    settings have (their own ValueError, as a usage error: no traceback)."""
    err = usage_error(tmp_path, capsys, "--configs", "--set", "no_such_setting=1", "--set", "column_slab=None",
                      "--set", "triton_backwards=False")
    assert "no_such_setting" in err and "triton_backwards" in err, err
    assert all(name in err for name in ("backend", "poison", "tiles", "column_slab")), err
    assert "Traceback" not in err


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
    assert table["moeblaze_cudagraphs"][6:8] == ["-", "-"]
    rows = {r["peer"]: r for r in measure.bench_train(ctx, ["smoke"])}
    assert set(CUDA_GRAPH_PEERS) <= set(rows)
    assert_timed(rows.values())
    assert all(math.isnan(rows[peer]["activation_gb"]) for peer in CUDA_GRAPH_PEERS)


def test_fp8_peer_runs_forward_only(monkeypatch):
    """``moeblaze_fp8``: offered in forward mode where every width is a multiple of 128 (not
    in train mode, not for a layer variant, not at the smoke config's d = 64), within its
    quantization of moeblaze's output, and timed by the forward benchmark without a
    training forward (it has no backward: measuring one would raise)."""
    from moeblaze_ops.bench import peers

    inputs = make_inputs(64, 256, 128, 4, 2, device="cpu")
    offered = peers(*inputs)
    assert "moeblaze_fp8" in offered
    assert "moeblaze_fp8" not in peers(*inputs, train=True)
    assert "moeblaze_fp8" not in peers(*inputs, variant={"activation": "gelu"})
    assert "moeblaze_fp8" not in peers(*make_inputs(*CONFIGS["smoke"], device="cpu"))
    with torch.no_grad():
        assert 1e-3 < rel_err(offered["moeblaze_fp8"](), offered["moeblaze"]()) < 1e-1
    monkeypatch.setitem(CONFIGS, "fp8_check", (64, 256, 128, 4, 2))
    ctx = measure.BenchContext(device="cpu", skip=frozenset(PEER_NAMES) - {"moeblaze", "moeblaze_fp8"})
    rows = {r["peer"]: r for r in measure.bench_forward(ctx, ["fp8_check"])}
    assert set(rows) == {"moeblaze", "moeblaze_fp8"}
    assert_timed(rows.values())
    assert math.isnan(rows["moeblaze_fp8"]["train_fwd_peak_gb"])


def test_dispatch_table_shows_graph_times_where_measured():
    """The dispatch rows' CUDA-graph columns (``--cudagraphs``) appear only where the rows
    have them, each speedup beside its own times."""
    from moeblaze_ops.bench.report import dispatch_table

    row = dict(L=64, K=2, E=8, sort_histc_cumsum_ms=0.3, moeblaze_kernels_ms=0.1, moeblaze_op_ms=0.15,
               speedup_kernels=3.0, speedup_op=2.0)
    graphed = dict(row, sort_histc_cumsum_graph_ms=0.2, moeblaze_kernels_graph_ms=0.04, moeblaze_op_graph_ms=0.05,
                   speedup_kernels_graph=5.0, speedup_op_graph=4.0)
    plain = table_rows(dispatch_table([row]), "64", key=1)["2"]
    assert plain[-1] == "3.0x / 2.0x" and len(plain) == 7
    cells = table_rows(dispatch_table([graphed]), "64", key=1)["2"]
    assert cells[3:7] == ["0.300", "0.100", "0.150", "3.0x / 2.0x"]
    assert cells[7:] == ["0.200", "0.040", "0.050", "5.0x / 4.0x"]


def test_dispatch_call_a_graph_cannot_capture_is_nan_with_a_note(monkeypatch, capsys):
    """With ``cuda_graphs``, a dispatch call whose capture fails reads nan in its columns
    (and speedups) and says why, instead of stopping the run."""
    monkeypatch.setattr(measure, "DISPATCH_CASES", [(16, 2, 4)])
    monkeypatch.setattr(measure, "time_ms", lambda fn, device, settle_s=0.0: 0.5)

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


def test_settle_steps_back_to_back_before_timing():
    """``time_ms(settle_s=...)`` calls the step back to back for at least ``settle_s``
    seconds before it times (settle 0: the 1 + 3 calls it always made), each call from no
    gradients, as the timed ones are."""
    t = torch.zeros(2, requires_grad=True)
    calls = []  # (when, whether .grad was None) of each call

    def step():
        calls.append((time.perf_counter(), t.grad is None))
        t.grad = torch.ones(2)
        time.sleep(0.002)

    measure.time_ms(step, "cpu", grad_to_none=(t,))
    assert [fresh for _, fresh in calls] == [True] * 4
    calls.clear()
    t0 = time.perf_counter()
    measure.time_ms(step, "cpu", grad_to_none=(t,), settle_s=0.05)
    assert all(fresh for _, fresh in calls)
    first_timed = calls[-4][0]  # the warm-up call and the 3 timed ones come last
    assert first_timed - t0 >= 0.05, first_timed - t0
    # 0.05 s of calls of 2 ms or more (a loaded machine sleeps longer): a handful at least,
    # and no batch far past the 0.05 s.
    assert 4 + 8 <= len(calls) <= 4 + 0.05 / 0.002 + 1, len(calls)


def test_settle_doubles_its_batches_and_syncs_after_each_alone(monkeypatch):
    """On CUDA ``settle`` syncs after batches of 1, 2, 4, ... calls, never after each call (a
    sync between small steps idles the GPU below its power limit), until ``settle_s`` has
    passed: here on a fake clock, each call 1 s, a sync free."""
    now, events = [0.0], []

    def call():
        now[0] += 1.0
        events.append("call")

    monkeypatch.setattr(measure.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    measure.settle(call, "cuda", 20.0)
    batches = [len(run) for run in "".join("c" if e == "call" else "|" for e in events).split("|")[:-1]]
    assert events[-1] == "sync" and batches == [1, 2, 4, 8, 5], batches  # the last batch cut to the 5 s left
    assert now[0] == 20.0


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

    def warm_up_like_do_bench(fn, device, reps_ms=200, grad_to_none=(), settle_s=0.0):
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


def test_tilt_skews_routing_toward_expert_0_and_nothing_else():
    """``make_inputs(tilt=...)`` changes the routing alone (same seed: same x and weights),
    makes the low experts busiest, and ``load_imbalance`` counts what bincount counts."""
    T, d, I, E, K = CONFIGS["smoke"]
    uniform = make_inputs(T, d, I, E, K, device="cpu")
    tilted = make_inputs(T, d, I, E, K, device="cpu", tilt=2.0)
    for i in (0, 3, 4):  # x, w_gate_up, w_down
        assert torch.equal(uniform[i], tilted[i])
    assert torch.equal(make_inputs(T, d, I, E, K, device="cpu", tilt=0.0)[1], uniform[1])
    counts = torch.bincount(tilted[1].reshape(-1), minlength=E)
    assert int(counts.argmax()) == 0 and counts[0] > counts[-1] * 4
    flipped = torch.bincount(make_inputs(T, d, I, E, K, device="cpu", tilt=-2.0)[1].reshape(-1), minlength=E)
    assert int(flipped.argmax()) == E - 1
    even, skewed = float(load_imbalance(uniform[1], E)), float(load_imbalance(tilted[1], E))
    assert even == pytest.approx(bincount_imbalance(uniform[1], E), rel=1e-12)
    assert skewed == pytest.approx(bincount_imbalance(tilted[1], E), rel=1e-12)
    assert 1 <= even < 1.5 and skewed > even + 0.75


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_tilt_rows_report_the_load_imbalance_of_their_routing(tmp_path, drawn, mode):
    """Every row gives its tilt and the max/mean expert load of the ids the peers were given
    (recounted here with bincount); a tilt makes it measurably larger than tilt 0's, on the
    same seed; the table shows it, and its heading the routing."""
    E = CONFIGS["smoke"][3]
    imbalance = {}
    for tilt in (0.0, 2.0):
        result, md = run(tmp_path / str(tilt), "--mode", mode, "--configs", "smoke", "--no-dispatch",
                         "--tilt", str(tilt), *only("hf_grouped_mm", "moeblaze"))
        rows = result[mode]
        assert [r["peer"] for r in rows] == ["hf_grouped_mm", "moeblaze"]
        (T, routing, ids), = drawn[-1:]
        assert routing == dict(UNIFORM, tilt=tilt) and len(drawn) == (1 if tilt == 0 else 2)
        imbalance[tilt] = bincount_imbalance(ids, E)
        assert result["tilt"] == tilt
        for r in rows:
            assert r["tilt"] == tilt and r["T"] == T
            assert r["load_imbalance"] == pytest.approx(imbalance[tilt], rel=1e-12)
        table = table_rows(md, "smoke")
        assert {cells[2] for cells in table.values()} == {f"{imbalance[tilt]:.2f}x"}
        heading = "uniform routing" if tilt == 0 else "router logits + 2*linspace(1, 0, E)"
        assert f"SwiGLU, {heading})" in md, md
    assert imbalance[0.0] < 1.5 and imbalance[2.0] > imbalance[0.0] + 0.75


def reference_routing(T, d, E, K, tilt=0.0, hot=0.0, empty=0, seed=0):
    """(ids, weights) of ``make_inputs``' routing recomputed here, each token's ids in
    ascending order: the logits drawn after x from the seed's generator, ``tilt`` and ``hot``
    added, the last ``empty`` experts' set to -inf, the top-K taken of the logits themselves
    (the softmax keeps their order) and the weights gathered from their softmax."""
    g = torch.Generator().manual_seed(seed)
    torch.randn(T, d, generator=g)  # x
    logits = torch.randn(T, E, generator=g) + tilt * torch.linspace(1, 0, E)
    logits[:, 0] += hot
    logits[:, E - empty:] = -math.inf  # none for empty 0
    ids = logits.topk(K, dim=-1).indices.sort(-1).values
    return ids, logits.softmax(-1).gather(1, ids)


def by_expert(ids, weights):
    """``ids`` and ``weights`` with each token's ids in ascending order."""
    order = ids.argsort(-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("routing", [dict(hot=4.0), dict(hot=-2.0), dict(empty=2), dict(empty=6),
                                     dict(tilt=2.0, hot=4.0, empty=2), dict(tilt=-1.0, hot=1.0, empty=1)])
def test_hot_and_empty_change_the_routing_alone(routing):
    """``make_inputs(hot=..., empty=...)``, alone, together and with a tilt: x and the weights
    are uniform routing's, and the routing is the top-K of the same random logits with ``hot``
    added to expert 0's and the last ``empty`` experts' left out (recomputed here)."""
    T, d, I, E, K = CONFIGS["smoke"]
    assert routing.get("empty", 0) <= E - K
    uniform = make_inputs(T, d, I, E, K, device="cpu")
    x, ids, w, w_gate_up, w_down = make_inputs(T, d, I, E, K, device="cpu", **routing)
    for got, want in zip((x, w_gate_up, w_down), (uniform[0], uniform[3], uniform[4])):
        assert torch.equal(got, want)
    assert not torch.equal(ids, uniform[1])
    want_ids, want_w = reference_routing(T, d, E, K, **routing)
    got_ids, got_w = by_expert(ids, w)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)


def test_hot_makes_expert_0_the_busiest():
    """``hot`` 4 puts expert 0 in nearly every token's top-K and the load imbalance well above
    uniform routing's; a negative one makes it the least busy; 0 is uniform routing."""
    T, d, I, E, K = CONFIGS["smoke"]
    uniform = make_inputs(T, d, I, E, K, device="cpu")[1]
    assert torch.equal(make_inputs(T, d, I, E, K, device="cpu", hot=0.0, empty=0)[1], uniform)
    hot = make_inputs(T, d, I, E, K, device="cpu", hot=4.0)[1]
    counts = torch.bincount(hot.reshape(-1), minlength=E)
    assert int(counts.argmax()) == 0 and counts[0] > 3 * counts[1:].max()
    assert float((hot == 0).any(-1).double().mean()) > 0.95
    cold = torch.bincount(make_inputs(T, d, I, E, K, device="cpu", hot=-4.0)[1].reshape(-1), minlength=E)
    assert int(cold.argmin()) == 0 and cold[0] * 3 < cold[1:].min()
    even, skewed = float(load_imbalance(uniform, E)), float(load_imbalance(hot, E))
    assert skewed == pytest.approx(bincount_imbalance(hot, E), rel=1e-12)
    assert even < 1.5 and skewed > even + 1.5


@pytest.mark.parametrize("empty", [1, 2, 6])
def test_empty_leaves_exactly_the_last_experts_without_rows(empty):
    """``make_inputs(empty=N)``: the last N experts get no row, every other expert some, each
    token still K distinct experts; x and the weights are uniform routing's, and a token whose
    uniform top-K missed the empty experts keeps it."""
    T, d, I, E, K = CONFIGS["smoke"]
    assert empty <= E - K
    uniform = make_inputs(T, d, I, E, K, device="cpu")
    x, ids, w, w_gate_up, w_down = make_inputs(T, d, I, E, K, device="cpu", empty=empty)
    for got, want in zip((x, w_gate_up, w_down), (uniform[0], uniform[3], uniform[4])):
        assert torch.equal(got, want)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert counts.numel() == E and int(counts[E - empty:].sum()) == 0 and bool((counts[:E - empty] > 0).all())
    assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all())  # K distinct experts per token
    kept = (uniform[1] < E - empty).all(-1)
    assert bool(kept.any()) and not bool(kept.all())
    assert torch.equal(ids[kept].sort(-1).values, uniform[1][kept].sort(-1).values)
    assert float(load_imbalance(ids, E)) == pytest.approx(bincount_imbalance(ids, E), rel=1e-12)


def test_too_many_empty_experts_is_a_value_error():
    """Fewer than K experts left for a token's K distinct choices (or a negative count):
    ``ValueError`` naming the numbers; E - K empty experts is the most allowed."""
    T, d, I, E, K = CONFIGS["smoke"]
    for empty in (E - K + 1, E, E + 3):
        with pytest.raises(ValueError, match=rf"empty={empty} leaves {E - empty} of the {E} experts, fewer than "
                                             rf"the K={K} .* at most {E - K} may be empty"):
            make_inputs(T, d, I, E, K, device="cpu", empty=empty)
    with pytest.raises(ValueError, match="empty must be at least 0, got -1"):
        make_inputs(T, d, I, E, K, device="cpu", empty=-1)
    assert int(make_inputs(T, d, I, E, K, device="cpu", empty=E - K)[1].max()) == K - 1


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_hot_and_empty_rows_report_their_routing(tmp_path, drawn, mode):
    """Every row and the run give the routing's tilt, hot and empty; the measurements draw
    with them; each row's load imbalance is that of the ids the peers got (recounted here),
    the empty experts got none, and the heading names the whole routing."""
    T, d, I, E, K = CONFIGS["smoke"]
    routing = dict(tilt=1.0, hot=4.0, empty=2)
    result, md = run(tmp_path, "--mode", mode, "--configs", "smoke", "--no-dispatch", "--tilt", "1", "--hot", "4",
                     "--empty", "2", *only("hf_grouped_mm", "moeblaze"))
    (drawn_T, drawn_routing, ids), = drawn
    assert drawn_T == T and drawn_routing == routing
    assert int(torch.bincount(ids.reshape(-1), minlength=E)[E - 2:].sum()) == 0
    imbalance = bincount_imbalance(ids, E)
    assert imbalance > bincount_imbalance(make_inputs(T, d, I, E, K, device="cpu")[1], E) + 1
    assert {key: result[key] for key in routing} == routing
    rows = result[mode]
    assert [r["peer"] for r in rows] == ["hf_grouped_mm", "moeblaze"]
    assert_timed(rows)
    for r in rows:
        assert {key: r[key] for key in routing} == routing and r["T"] == T
        assert r["load_imbalance"] == pytest.approx(imbalance, rel=1e-12)
    if mode == "forward":  # moeblaze agrees with grouped_mm with experts left empty
        assert rows[1]["rel_diff_vs_first"] < 1e-3
    assert {cells[2] for cells in table_rows(md, "smoke").values()} == {f"{imbalance:.2f}x"}
    assert "SwiGLU, router logits + 1*linspace(1, 0, E), + 4 on expert 0, last 2 experts empty)" in md, md


def test_routing_heading_names_every_change():
    from moeblaze_ops.bench.report import routing

    assert routing(0.0) == routing(0.0, 0.0, 0) == "uniform routing"
    assert routing(2.0) == routing(2.0, 0.0, 0) == "router logits + 2*linspace(1, 0, E)"
    assert routing(2.0, 4.0, 2) == "router logits + 2*linspace(1, 0, E), + 4 on expert 0, last 2 experts empty"
    assert routing(0.0, 4.0) == "router logits + 4 on expert 0"
    assert routing(0.0, -0.5) == "router logits - 0.5 on expert 0"
    assert routing(0.0, 0.0, 1) == "uniform routing, last expert empty"
    assert routing(-1.5, 0.0, 3) == "router logits - 1.5*linspace(1, 0, E), last 3 experts empty"


def test_empty_is_checked_for_every_config_before_measuring(tmp_path, capsys, monkeypatch):
    """``--empty`` more than a config the run would measure allows (E - K) is a usage error
    naming that config, before any config is measured; as many as each allows runs."""
    measured = []
    monkeypatch.setattr(cli, "bench_forward", lambda ctx, names: measured.append((ctx.empty, names)) or [])
    monkeypatch.setattr(cli, "bench_train", lambda ctx, names: measured.append((ctx.empty, names)) or [])
    (_, _, _, small_E, small_K), (_, _, _, big_E, big_K) = CONFIGS["smoke"], CONFIGS["olmoe"]
    empty = small_E - small_K + 1
    assert empty <= big_E - big_K  # olmoe allows it, smoke does not
    for mode in ("forward", "train"):
        err = usage_error(tmp_path, capsys, "--mode", mode, "--configs", "olmoe", "smoke", "--empty", str(empty))
        assert f"--empty {empty}: config smoke " in err and "olmoe" not in err.splitlines()[-1], err
    # No --configs: every config is checked; the first that has too few experts is named.
    first = next(name for name, (_, _, _, E, K) in CONFIGS.items() if E - K < empty)
    assert f"config {first} " in usage_error(tmp_path, capsys, "--empty", str(empty))
    assert measured == []
    run(tmp_path, "--configs", "olmoe", "smoke", "--no-dispatch", "--empty", str(empty - 1))
    assert measured == [(empty - 1, ["olmoe", "smoke"])]


def test_tokens_runs_each_config_at_each_token_count(tmp_path, drawn):
    """``--tokens`` in place of the config's own T: one row per token count and peer, each
    with its T and time per token, on inputs of that T and the config's other dimensions;
    the table tells the token counts apart."""
    result, md = run(tmp_path, "--configs", "smoke", "--no-dispatch", "--tokens", "16", "48", "16",
                     *only("moeblaze"))
    assert result["tokens"] == [16, 48]  # a count given twice is measured once
    assert [T for T, _, _ in drawn] == [16, 48]
    _, d, I, E, K = CONFIGS["smoke"]
    assert all(ids.shape == (T, K) and int(ids.max()) < E for T, _, ids in drawn)
    rows = result["forward"]
    assert [(r["config"], r["T"], r["peer"]) for r in rows] == [("smoke", 16, "moeblaze"), ("smoke", 48, "moeblaze")]
    assert_timed(rows)
    for r, (T, _, ids) in zip(rows, drawn):
        assert r["us_per_token"] == pytest.approx(r["ms"] * 1e3 / T)
        assert r["tflops"] == pytest.approx(6 * T * K * d * I / r["ms"] / 1e9)
        assert r["load_imbalance"] == pytest.approx(bincount_imbalance(ids, E), rel=1e-12)
    cells = [line.split("|")[1:-1] for line in md.splitlines() if line.startswith("| smoke |")]
    assert [(c[1].strip(), c[3].strip(), c[4].strip()) for c in cells] == [
        (str(r["T"]), "moeblaze", f"{r['ms']:.3f}") for r in rows]


def test_tokens_in_train_mode(tmp_path, drawn):
    result, _ = run(tmp_path, "--mode", "train", "--configs", "smoke", "--no-dispatch", "--tokens", "24",
                    *only("moeblaze"))
    assert [(r["T"], r["peer"]) for r in result["train"]] == [(24, "moeblaze")]
    assert [T for T, _, _ in drawn] == [24]
    # moeblaze keeps h, the index arrays and topk_weights of 24 tokens (test_train_smoke's count)
    _, d, I, E, K = CONFIGS["smoke"]
    LK = 24 * K
    assert result["train"][0]["activation_bytes"] == LK * 2 * I * 4 + LK * 4 + (E + 1) * 4 + LK * 4 + LK * 4


def test_compiled_autograd_peer_runs_its_backward_under_it(tmp_path):
    """Train mode's ``moeblaze_compiled_autograd``: its backward under compiled autograd
    (a capture counted), moeblaze's not; the same activation memory as moeblaze's, its
    gradients equal to eager's."""
    from moeblaze_ops.bench import implementations

    counters = torch._dynamo.utils.counters["compiled_autograd"]
    torch._dynamo.reset()
    result, _ = run(tmp_path, "--mode", "train", "--configs", "smoke", *only("moeblaze", "moeblaze_compiled_autograd"))
    rows = {r["peer"]: r for r in result["train"]}
    assert set(rows) == {"moeblaze", "moeblaze_compiled_autograd"}
    assert rows["moeblaze_compiled_autograd"]["activation_bytes"] == rows["moeblaze"]["activation_bytes"]

    T, d, I, E, K = CONFIGS["smoke"]
    x, ids, w, w_gate_up, w_down = make_inputs(T, d, I, E, K, device="cpu")
    grad = torch.randn_like(x)
    grads = {}
    torch._dynamo.reset()  # the run's compiled backward cached: this one captures afresh
    for peer in ("moeblaze", "moeblaze_compiled_autograd"):
        for t in (x, w, w_gate_up, w_down):
            t.grad = None
            t.requires_grad_(True)
        fn = implementations.peers(x, ids, w, w_gate_up, w_down, train=True)[peer]
        captures = counters["captures"]
        implementations.train_step(fn, grad)
        assert (counters["captures"] > captures) == (peer == "moeblaze_compiled_autograd"), peer
        grads[peer] = [t.grad.clone() for t in (x, w, w_gate_up, w_down)]
    for got, want in zip(grads["moeblaze_compiled_autograd"], grads["moeblaze"]):
        assert rel_err(got, want) < 1e-5


def test_tables_compare_peers_at_the_same_token_count():
    """The speed column's base is the compiled grouped_mm row of the same config and T."""
    from moeblaze_ops.bench.report import forward_table, train_table

    def row(T, peer, ms):
        return dict(config="c", T=T, tilt=0.0, load_imbalance=1.0 + T / 1000, peer=peer, ms=ms, tflops=1.0,
                    peak_gb=1.0, train_fwd_peak_gb=1.0, activation_gb=1.0, accumulate_peak_gb=1.0)

    rows = [row(8, "hf_grouped_mm_compiled", 1.0), row(8, "moeblaze", 0.5),
            row(64, "hf_grouped_mm_compiled", 6.0), row(64, "moeblaze", 2.0), row(512, "moeblaze", 9.0)]
    for table, speed in ((forward_table(rows), 8), (train_table(rows), 8)):
        cells = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()
                 if line.startswith("| c |")]
        assert [(c[1], c[2], c[3], c[speed]) for c in cells] == [
            ("8", "1.01x", "hf_grouped_mm_compiled", "1.00x"), ("8", "1.01x", "moeblaze", "2.00x"),
            ("64", "1.06x", "hf_grouped_mm_compiled", "1.00x"), ("64", "1.06x", "moeblaze", "3.00x"),
            ("512", "1.51x", "moeblaze", "-")]


def test_tokens_default_per_mode(tmp_path, monkeypatch):
    """No ``--tokens``: forward and train modes keep each config's T, decode mode its grid;
    the measurements get the tokens and tilt given."""
    seen = []
    monkeypatch.setattr(cli, "bench_forward", lambda ctx, names: seen.append(ctx) or [])
    monkeypatch.setattr(cli, "bench_train", lambda ctx, names: seen.append(ctx) or [])
    monkeypatch.setattr(cli.decode, "run_decode", lambda opts, out, record: seen.append(opts) or (None, []))
    run(tmp_path, "--configs", "smoke", "--no-dispatch")
    _, md = run(tmp_path, "--mode", "train", "--configs", "smoke", "--no-dispatch", "--tokens", "7", "--tilt", "-1.5")
    assert "## forward + backward (SwiGLU, router logits - 1.5*linspace(1, 0, E))" in md
    main(["--device", "cpu", "--out", str(tmp_path), "--mode", "decode", "--configs", "smoke_decode"])
    main(["--device", "cpu", "--out", str(tmp_path), "--mode", "decode", "--configs", "smoke_decode", "--tokens", "5"])
    assert (seen[0].tokens, seen[0].tilt, seen[0].hot, seen[0].empty) == (None, 0.0, 0.0, 0)
    assert (seen[1].tokens, seen[1].tilt) == ((7,), -1.5)
    assert seen[2].tokens == DECODE_TOKENS and seen[3].tokens == (5,)


def test_settle_reaches_every_timing_and_bench_json(tmp_path, monkeypatch):
    """``--settle S`` is the context's ``settle_s``, which every timing of the run gets, and
    bench.json records it (0 without the flag)."""
    real_time_ms, settles = measure.time_ms, []

    def time_ms_spy(fn, device, *args, **kwargs):
        settles.append(kwargs.get("settle_s"))
        return real_time_ms(fn, device, *args, **kwargs)

    monkeypatch.setattr(measure, "time_ms", time_ms_spy)
    result, _ = run(tmp_path / "settled", "--mode", "train", "--configs", "smoke", "--no-dispatch", "--settle",
                    "0.01", *only("hf_grouped_mm", "moeblaze"))
    assert result["settle_s"] == 0.01 and len(result["train"]) == 2
    assert settles == [0.01, 0.01]
    assert_timed(result["train"])
    settles.clear()
    result, _ = run(tmp_path / "plain", "--configs", "smoke", "--no-dispatch", *only("moeblaze"))
    assert result["settle_s"] == 0 and settles == [0.0]


@pytest.mark.parametrize("args,message", [
    (["--tokens", "-5"], "argument --tokens: must be at least 1, got -5"),
    (["--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
    (["--mode", "train", "--tokens", "64", "-3"], "argument --tokens: must be at least 1, got -3"),
    (["--tokens", "1.5"], "argument --tokens: invalid positive_int value: '1.5'"),
    (["--tilt", "inf"], "argument --tilt: must be finite, got inf"),
    (["--tilt", "nan"], "argument --tilt: must be finite, got nan"),
    (["--tilt=-inf"], "argument --tilt: must be finite, got -inf"),
    (["--tilt", "steep"], "argument --tilt: invalid finite_float value: 'steep'"),
    (["--mode", "decode", "--configs", "smoke_decode", "--tilt", "1"], "--tilt is for forward and train modes"),
    (["--hot", "inf"], "argument --hot: must be finite, got inf"),
    (["--hot", "nan"], "argument --hot: must be finite, got nan"),
    (["--hot", "very"], "argument --hot: invalid finite_float value: 'very'"),
    (["--empty", "-1"], "argument --empty: must be at least 0, got -1"),
    (["--empty", "1.5"], "argument --empty: invalid non_negative_int value: '1.5'"),
    (["--empty", str(CONFIGS["smoke"][3] - CONFIGS["smoke"][4] + 1)],
     f"--empty {CONFIGS['smoke'][3] - CONFIGS['smoke'][4] + 1}: config smoke "),
    (["--mode", "train", "--empty", str(CONFIGS["smoke"][3])], f"--empty {CONFIGS['smoke'][3]}: config smoke "),
    (["--mode", "decode", "--configs", "smoke_decode", "--hot", "1"], "--hot is for forward and train modes"),
    (["--mode", "decode", "--configs", "smoke_decode", "--empty", "1"], "--empty is for forward and train modes"),
    (["--settle", "-1"], "argument --settle: must be finite and at least 0, got -1.0"),
    (["--settle", "inf"], "argument --settle: must be finite and at least 0, got inf"),
    (["--settle", "nan"], "argument --settle: must be finite and at least 0, got nan"),
    (["--settle", "long"], "argument --settle: invalid non_negative_float value: 'long'"),
    (["--mode", "decode", "--configs", "smoke_decode", "--settle", "1"], "--settle is for forward and train modes"),
])
def test_bad_tokens_and_tilt_are_usage_errors(tmp_path, capsys, args, message):
    err = usage_error(tmp_path, capsys, *(["--configs", "smoke"] if "--configs" not in args else []), *args)
    assert message in err, err
    assert not (tmp_path / "decode.json").exists()


@pytest.fixture
def peer_calls(monkeypatch):
    """Every ``peers`` call the measurements make, as (its inputs, its ``variant`` keyword
    arguments, the outputs of its ``moeblaze`` peer's calls, detached)."""
    from moeblaze_ops.bench import implementations

    calls = []

    def peers_spy(*inputs, variant=None, **kwargs):
        fns = implementations.peers(*inputs, variant=variant, **kwargs)
        outs = []
        calls.append((inputs, dict(variant or {}), outs))
        eager = fns["moeblaze"]

        def moeblaze():
            out = eager()
            outs.append(out.detach().clone())
            return out

        fns["moeblaze"] = moeblaze
        return fns

    monkeypatch.setattr(measure, "peers", peers_spy)
    return calls


#: The layer each variant's table heading names.
VARIANT_HEADINGS = {"none": "SwiGLU", "bias": "SwiGLU with biases",
                    "clamped": "GPT-OSS clamped SwiGLU, interleaved, with biases", "fp16": "SwiGLU, fp16"}


def variant_reference(variant, x, ids, w, w_gate_up, w_down, b_gate_up, b_down):
    """The float64 output of ``variant``'s layer (``moeblaze_ops.testing.reference_moe``):
    SwiGLU with the biases for ``bias``; GPT-OSS's clamped SwiGLU (alpha 1.702, limit 7),
    gate and up columns interleaved, with the biases for ``clamped``."""
    from moeblaze_ops.testing import reference_moe

    layer = dict(bias=dict(activation="swiglu", interleaved=False),
                 clamped=dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0))[variant]
    return reference_moe(x.double(), ids, w.double(), w_gate_up.double(), w_down.double(),
                         b_gate_up=b_gate_up.double(), b_down=b_down.double(), **layer)


def reference_moe_plain(x, ids, w, w_gate_up, w_down):
    """The float64 output of the plain SwiGLU layer without biases."""
    from moeblaze_ops.testing import reference_moe

    return reference_moe(x.double(), ids, w.double(), w_gate_up.double(), w_down.double())


def assert_biases(variant_kwargs, w_gate_up, w_down):
    """The variant's biases: [E, 2I] and [E, d] in the weights' dtype, of scale about 0.1."""
    E, N, d = w_gate_up.shape
    b_gate_up, b_down = variant_kwargs["b_gate_up"], variant_kwargs["b_down"]
    assert b_gate_up.shape == (E, N) and b_down.shape == (E, d) and N == 2 * w_down.shape[2]
    assert b_gate_up.dtype == b_down.dtype == w_gate_up.dtype
    for b in (b_gate_up, b_down):
        b = b.detach().double()
        assert 0.07 < float(b.std()) < 0.13 and abs(float(b.mean())) < 0.05
    return b_gate_up, b_down


@pytest.mark.parametrize("mode", ["forward", "train"])
@pytest.mark.parametrize("variant", ["bias", "clamped"])
def test_variant_layers_run_on_moeblazes_peers_alone(tmp_path, peer_calls, capsys, mode, variant):
    """``--variant bias`` and ``clamped``: HF's peers left out (with a note) though not
    skipped, moeblaze's given the variant's layer, whose eager output equals the float64
    reference of that layer (and not plain SwiGLU's); rows, run and heading name it."""
    kept = ("hf_eager", "hf_grouped_mm", "moeblaze") + (("moeblaze_compiled",) if mode == "forward"
                                                         else ("moeblaze_recompute",))
    result, md = run(tmp_path, "--mode", mode, "--configs", "smoke", "--no-dispatch", "--variant", variant,
                     *only(*kept))
    rows = result[mode]
    assert [r["peer"] for r in rows] == ["moeblaze", kept[-1]]
    assert result["variant"] == variant and all(r["variant"] == variant for r in rows)
    assert_timed(rows)
    (inputs, layer, outs), = peer_calls
    x, ids, w, w_gate_up, w_down = inputs
    b_gate_up, b_down = assert_biases(layer, w_gate_up, w_down)
    ref = variant_reference(variant, x, ids, w, w_gate_up, w_down, b_gate_up, b_down)
    assert outs and all(rel_err(out, ref) < 1e-4 for out in outs), [rel_err(out, ref) for out in outs]
    plain = reference_moe_plain(x, ids, w, w_gate_up, w_down)
    assert rel_err(plain, ref) > 1e-2  # the check tells the variant's layer from plain SwiGLU
    if mode == "forward":
        assert rows[0]["rel_diff_vs_first"] == 0 and rows[1]["rel_diff_vs_first"] < 1e-4
    heading = f"## forward (fp32, {VARIANT_HEADINGS[variant]}, uniform routing)" if mode == "forward" else \
        f"## forward + backward ({VARIANT_HEADINGS[variant]}, uniform routing)"
    assert heading in md, md
    assert set(table_rows(md, "smoke")) == {"moeblaze", kept[-1]}
    notes = [line for line in capsys.readouterr().err.splitlines() if "SonicMoE" in line]
    assert len(notes) == 1 and f"--variant {variant}" in notes[0] and "plain SwiGLU" in notes[0], notes


def test_every_moeblaze_peer_computes_the_variants_layer():
    """``peers(..., variant=...)``: the moeblaze peers alone, every one of them (compiled,
    recompute, compiled autograd, reduce-overhead) computing GPT-OSS's layer with the biases;
    no variant keeps HF's peers."""
    from moeblaze_ops.bench import peers
    from moeblaze_ops.bench.configs import make_variant

    torch._dynamo.reset()
    T, d, I, E, K = CONFIGS["smoke"]
    inputs = make_inputs(T, d, I, E, K, device="cpu")
    assert "hf_eager" in peers(*inputs) and "hf_eager" in peers(*inputs, variant={})
    layer = make_variant("clamped", inputs[3], inputs[4])
    fns = peers(*inputs, train=True, cuda_graphs=True, variant=layer)
    # The FP8 peer computes the plain layer in forward mode alone.
    assert list(fns) == [name for name in PEER_NAMES if name.startswith("moeblaze") and name != "moeblaze_fp8"]
    ref = variant_reference("clamped", *inputs, *assert_biases(layer, inputs[3], inputs[4]))
    with torch.no_grad():
        for name, fn in fns.items():
            assert rel_err(fn(), ref) < 1e-4, name


def test_bias_variant_keeps_x_weights_and_routing(tmp_path, peer_calls):
    """The biases come from a generator of their own: x, the weights and the routing the
    peers get under ``--variant bias`` (and ``clamped``) are ``none``'s, and both variants
    have the same biases; ``none`` passes no variant arguments."""
    for variant in ("none", "bias", "clamped"):
        run(tmp_path / variant, "--configs", "smoke", "--no-dispatch", "--variant", variant, *only("moeblaze"))
    (plain, none_layer, _), (biased, bias_layer, _), (clamped, clamped_layer, _) = peer_calls
    assert none_layer == {}
    for got in (biased, clamped):
        assert all(torch.equal(a, b) for a, b in zip(got, plain))
    assert set(bias_layer) == {"b_gate_up", "b_down"}
    assert {k: v for k, v in clamped_layer.items() if k not in bias_layer} == dict(activation="clamped_swiglu",
                                                                                 interleaved=True)
    for name in ("b_gate_up", "b_down"):
        assert torch.equal(bias_layer[name], clamped_layer[name])
    # Not drawn from make_inputs' generator, whose stream they would otherwise repeat.
    g = torch.Generator().manual_seed(0)
    T, d, I, E, K = CONFIGS["smoke"]
    first = torch.randn(E * 2 * I, generator=g).reshape(E, 2 * I)
    assert not torch.allclose(bias_layer["b_gate_up"], 0.1 * first)


def test_fp16_variant_gives_every_peer_fp16_inputs(peer_calls):
    """The fp16 variant's layer is float16 for every peer (measured here directly: the
    command line makes it a CUDA option); the rows carry it."""
    ctx = measure.BenchContext(device="cpu", skip=frozenset(set(PEER_NAMES) - {"hf_grouped_mm", "moeblaze"}),
                               variant="fp16")
    rows = measure.bench_forward(ctx, ["smoke"])
    assert [r["peer"] for r in rows] == ["hf_grouped_mm", "moeblaze"]
    assert all(r["variant"] == "fp16" for r in rows)
    (inputs, layer, outs), = peer_calls
    assert layer == {} and [t.dtype for t in inputs] == [torch.float16, torch.int64, torch.float32, torch.float16,
                                                         torch.float16]
    assert outs[0].dtype == torch.float16
    ref = reference_moe_plain(*inputs)
    assert rel_err(outs[0], ref) < 3e-3 and rows[1]["rel_diff_vs_first"] < 3e-3


def test_variant_headings_name_the_layer():
    from moeblaze_ops.bench.report import layer

    for variant, text in VARIANT_HEADINGS.items():
        assert layer(variant) == text
    assert layer("none", "bf16") == "bf16, SwiGLU" and layer("bias", "bf16") == "bf16, SwiGLU with biases"
    assert layer("fp16", "bf16") == "fp16, SwiGLU"


@pytest.mark.parametrize("args,message", [
    (["--variant", "fp16"], "--variant fp16 needs --device cuda: on the CPU the benchmark computes in fp32"),
    (["--mode", "train", "--variant", "fp16"], "--variant fp16 needs --device cuda"),
    (["--variant", "nope"], "argument --variant: invalid choice: 'nope'"),
    (["--mode", "decode", "--configs", "smoke_decode", "--variant", "bias"],
     "--variant bias is for forward and train modes"),
    (["--mode", "decode", "--configs", "smoke_decode", "--variant", "clamped"],
     "--variant clamped is for forward and train modes"),
])
def test_bad_variants_are_usage_errors(tmp_path, capsys, args, message):
    err = usage_error(tmp_path, capsys, *(["--configs", "smoke"] if "--configs" not in args else []), *args)
    assert message in err, err
    assert not (tmp_path / "decode.json").exists()
