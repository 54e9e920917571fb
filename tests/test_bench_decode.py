"""The benchmark's decode mode on CPU: its rows, its memory floor, the output check before
timing, and the rotation over copies of the weights (the GPU numbers come from the GPU
machine; nothing here asserts a time)."""

import importlib.util
import json
import math

import pytest
import torch

import moeblaze_ops
from moeblaze_ops.bench import decode, main
from moeblaze_ops.bench.configs import DECODE_SHAPES
from moeblaze_ops.testing import rel_err

TOKENS = (1, 3, 8)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the smoke shape's tiny matmuls otherwise wait for threads that
    pytest-xdist's other workers keep busy (hundreds of ms a call on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_decode(tmp_path, *args):
    """Runs decode mode on CPU at smoke_decode, tokens 1 3 8, a 0.25 MB bandwidth buffer and
    few calls; returns decode.json's dict."""
    main(["--mode", "decode", "--device", "cpu", "--configs", "smoke_decode", "--tokens", *map(str, TOKENS),
          "--bandwidth-mb", "0.25", "--calls", "4", "--repeats", "1", "--out", str(tmp_path), *args])
    return json.loads((tmp_path / "decode.json").read_text())


@pytest.fixture
def spied(monkeypatch):
    """Records the draws the run builds (per T) and the ``w_gate_up`` each moeblaze call reads."""
    seen = dict(draws={}, moeblaze_weights=[])
    build_draws, moe_experts = decode.build_draws, moeblaze_ops.moe_experts

    def build_draws_spy(T, *args, **kwargs):
        seen["draws"][T] = build_draws(T, *args, **kwargs)
        return seen["draws"][T]

    def moe_experts_spy(x, ids, w, w_gate_up, w_down, **kwargs):
        seen["moeblaze_weights"].append(w_gate_up.data_ptr())
        return moe_experts(x, ids, w, w_gate_up, w_down, **kwargs)

    monkeypatch.setattr(decode, "build_draws", build_draws_spy)
    monkeypatch.setattr(moeblaze_ops, "moe_experts", moe_experts_spy)
    return seen


def test_decode_smoke_rows_floor_and_outputs(tmp_path, spied, capsys):
    result = run_decode(tmp_path, "--nominal-tbps", "2.0")
    rows = {(r["shape"], r["T"], r["peer"]): r for r in result["rows"]}
    assert set(rows) == {("smoke_decode", T, peer) for T in TOKENS for peer in ("moeblaze", "grouped_mm")}
    assert result["device"] == "CPU" and result["mode"] == "decode" and result["torch"] == torch.__version__
    assert result["dtype"] == "float32" and result["nominal_tbps"] == 2.0
    assert math.isfinite(result["measured_tbps"]) and result["measured_tbps"] > 0
    assert result["bandwidth_buffer_bytes"] == 2**18
    d, I, E, K = DECODE_SHAPES["smoke_decode"]
    for T in TOKENS:
        draws = spied["draws"][T]
        # The floor's expert count, recounted here from the routing the run used.
        counts = [len(set(draw.ids.flatten().tolist())) for draw in draws]
        assert all(1 <= c <= min(E, T * K) for c in counts)
        moved = sum(counts) / len(counts) * 3 * d * I * 4 + 2 * T * d * 4
        for peer in ("moeblaze", "grouped_mm"):
            r = rows[("smoke_decode", T, peer)]
            assert r["distinct_experts_per_draw"] == counts and r["draws"] == len(draws)
            assert r["floor_bytes"] == pytest.approx(moved)
            assert r["floor_us_nominal"] == pytest.approx(moved / 2.0e12 * 1e6)
            assert r["floor_us_measured"] == pytest.approx(moved / (result["measured_tbps"] * 1e12) * 1e6)
            assert math.isfinite(r["us"]) and r["us"] > 0 and "error" not in r
            assert r["share_of_floor_measured"] == pytest.approx(r["floor_us_measured"] / r["us"])
        assert rows[("smoke_decode", T, "moeblaze")]["rel_err_vs_grouped_mm"] < 1e-5
        assert rows[("smoke_decode", T, "grouped_mm")]["rel_err_vs_grouped_mm"] == 0
    # T=1 with K=2 hits exactly two experts in every draw.
    assert rows[("smoke_decode", 1, "moeblaze")]["distinct_experts_per_draw"] == [2] * len(spied["draws"][1])
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| smoke_decode |")]
    assert [line.split("|")[2].strip() for line in table] == [str(T) for T in TOKENS]
    assert (tmp_path / "decode.md").read_text().count("| smoke_decode |") == len(TOKENS)
    if importlib.util.find_spec("matplotlib") is None:
        assert not (tmp_path / "decode.png").exists()
    else:
        assert (tmp_path / "decode.png").stat().st_size > 0


def test_timed_calls_rotate_over_draws_of_distinct_weights(tmp_path, spied):
    """Each draw owns its weights (distinct storage, distinct values), and the timed calls
    go round the draws in order, so no call finds the last call's weights in cache."""
    run_decode(tmp_path)
    for T in TOKENS:
        draws = spied["draws"][T]
        assert len(draws) >= 2
        ptrs = [draw.w_gate_up.data_ptr() for draw in draws]
        assert len(set(ptrs)) == len(draws)
        assert len({draw.w_down.data_ptr() for draw in draws}) == len(draws)
        assert not torch.equal(draws[0].w_gate_up, draws[1].w_gate_up)
        assert len({draw.x.data_ptr() for draw in draws}) == len(draws)
    # The last T's timed moeblaze calls are the last ones made: 4 calls, round the draws.
    ptrs = [draw.w_gate_up.data_ptr() for draw in spied["draws"][TOKENS[-1]]]
    assert spied["moeblaze_weights"][-4:] == [ptrs[i % len(ptrs)] for i in range(4)]
    assert set(spied["moeblaze_weights"]) >= {d.w_gate_up.data_ptr() for T in TOKENS for d in spied["draws"][T]}


def test_output_mismatch_refuses_to_time(monkeypatch):
    """A peer whose output differs from grouped_mm's stops the run before it is timed."""
    moe_experts = moeblaze_ops.moe_experts
    timed = []
    monkeypatch.setattr(moeblaze_ops, "moe_experts", lambda *args, **kwargs: moe_experts(*args, **kwargs) * 1.001)
    monkeypatch.setattr(decode, "time_per_call_us", lambda *args: timed.append(args) or 1.0)
    opts = decode.DecodeOptions(shapes=("smoke_decode",), tokens=(3,), device="cpu", bandwidth_mb=0.25, calls=2,
                                repeats=1)
    with pytest.raises(decode.OutputMismatch, match=r"smoke_decode T=3: moeblaze's output differs"):
        decode.bench_decode(opts)
    assert timed == []


def test_a_peer_that_fails_reads_failed_and_the_others_are_timed(monkeypatch, capsys):
    peer_call = decode._peer_call

    def failing(peer, fns):
        if peer == "grouped_mm":
            raise RuntimeError("no kernel\nsecond line")
        return peer_call(peer, fns)

    monkeypatch.setattr(decode, "_peer_call", failing)
    opts = decode.DecodeOptions(shapes=("smoke_decode",), tokens=(2,), device="cpu", bandwidth_mb=0.25, calls=2,
                                repeats=1)
    rows = {r["peer"]: r for r in decode.bench_decode(opts)["rows"]}
    assert math.isnan(rows["grouped_mm"]["us"]) and rows["grouped_mm"]["error"] == "RuntimeError: no kernel"
    assert math.isfinite(rows["moeblaze"]["us"]) and math.isnan(rows["moeblaze"]["speedup_vs_grouped_mm"])
    assert "bench: grouped_mm not timed at smoke_decode T=2: RuntimeError: no kernel" in capsys.readouterr().err
    (line,) = [cells for cells in decode.decode_table(list(rows.values())).splitlines() if "| smoke_decode |" in cells]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[6] == "failed" and cells[-1] == "-" and cells[-2].endswith("(moeblaze)")


def test_table_shows_the_best_moeblaze_peer_against_grouped_mm():
    base = dict(shape="s", T=4, distinct_experts=3.0, floor_us_nominal=5.0, floor_us_measured=6.0)
    rows = [dict(base, peer="moeblaze_cudagraphs", us=20.0, share_of_floor_measured=0.3, speedup_vs_grouped_mm=2.0),
            dict(base, peer="moeblaze_graph", us=12.0, share_of_floor_measured=0.5, speedup_vs_grouped_mm=40 / 12),
            dict(base, peer="grouped_mm_compiled", us=40.0, share_of_floor_measured=0.15, speedup_vs_grouped_mm=1.0)]
    lines = decode.decode_table(rows).splitlines()
    assert lines[0].split("|")[6:9] == [" moeblaze_cudagraphs us ", " moeblaze_graph us ", " grouped_mm_compiled us "]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == ["s", "4", "3.00", "5.0", "6.0", "20.0", "12.0", "40.0", "50% (moeblaze_graph)", "3.33x"]


@pytest.mark.parametrize("weight_bytes,l2,free,expected", [
    (2_818_572_288, 50 * 2**20, 80e9, 2),  # Mixtral on an H100: two copies already exceed four L2s
    (10 * 2**20, 50 * 2**20, 80e9, 16),  # small weights: 20 copies wanted, capped at 16
    (3 * 2**20, 50 * 2**20, 80e9, 16),
    (40 * 2**20, 50 * 2**20, 80e9, 5),  # ceil(200 / 40)
    (2_818_572_288, 50 * 2**20, 10e9, 1),  # 40% of 10 GB holds one copy: never none
    (40 * 2**20, 50 * 2**20, 300 * 2**20, 3),  # 40% of 300 MB holds three
    (1000, None, None, 2),  # CPU: no L2 known, the minimum
])
def test_draw_count(weight_bytes, l2, free, expected):
    assert decode.draw_count(weight_bytes, l2, free) == expected


@pytest.mark.parametrize("args,message", [
    (["--mode", "decode", "--configs", "smoke"], "--configs: smoke not measured in decode mode"),
    (["--configs", "smoke_decode"], "--configs: smoke_decode not measured in forward mode"),
    (["--mode", "decode", "--configs", "smoke_decode", "--skip", "hf_eager"], "--skip: hf_eager not a peer of decode"),
    (["--configs", "smoke", "--skip", "moeblaze_graph"], "--skip: moeblaze_graph not a peer of forward mode"),
    (["--mode", "decode", "--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
])
def test_names_of_another_mode_are_usage_errors(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cpu", "--out", str(tmp_path), *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "decode.json").exists() and not (tmp_path / "bench.json").exists()


def test_stacked_layers_run_every_draw_in_turn():
    """A graph peer's stack (``--layers-per-graph``) runs its layer once per layer, on the
    draws in turn, and returns every layer's output: each equals that draw's own layer."""
    weights = decode.make_weights(16, 8, 4, 2, torch.float32, "cpu", 0)
    draws = decode.build_draws(3, 2, weights, torch.float32, "cpu", 0)
    seen = []

    def layer(x, ids, w, w_gate_up, w_down):
        seen.append(w_gate_up.data_ptr())
        return moeblaze_ops.moe_experts(x, ids, w, w_gate_up, w_down)

    model, args = decode.stacked_layers(layer, draws, 5)
    outs = model(*args)
    assert len(outs) == 5 and seen == [draws[i % 2].w_gate_up.data_ptr() for i in range(5)]
    for i, out in enumerate(outs):
        ref = moeblaze_ops.moe_experts(*draws[i % 2].inputs)
        assert rel_err(out, ref) == 0
