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


def run_decode(tmp_path, *args, configs=("smoke_decode",), tokens=TOKENS):
    """Runs decode mode on CPU at ``configs`` (smoke_decode), ``tokens`` (1 3 8), a 0.25 MB
    bandwidth buffer and few calls; returns decode.json's dict."""
    main(["--mode", "decode", "--device", "cpu", "--configs", *configs, "--tokens", *map(str, tokens),
          "--bandwidth-mb", "0.25", "--calls", "4", "--repeats", "1", "--out", str(tmp_path), *args])
    return json.loads((tmp_path / "decode.json").read_text())


def table_cells(text, shape):
    """The decode table's lines of ``shape`` in ``text``, each as {column header: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("| shape |") or line.startswith(f"| {shape} |")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, [c.strip() for c in line.strip("|").split("|")], strict=True)) for line in lines[1:]]


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
    (cells,) = table_cells(decode.decode_table(list(rows.values())), "smoke_decode")
    assert cells["grouped_mm us"] == "failed" and cells["vs grouped_mm"] == "-"
    assert cells["moeblaze best: share of measured floor"].endswith("(moeblaze)")


def test_table_shows_the_best_moeblaze_peer_against_grouped_mm():
    base = dict(shape="s", T=4, distinct_experts=3.0, floor_us_nominal=5.0, floor_us_measured=6.0)
    rows = [dict(base, peer="moeblaze_cudagraphs", us=20.0, share_of_floor_measured=0.3, speedup_vs_grouped_mm=2.0),
            dict(base, peer="moeblaze_graph", us=12.0, share_of_floor_measured=0.5, speedup_vs_grouped_mm=40 / 12),
            dict(base, peer="grouped_mm_compiled", us=40.0, share_of_floor_measured=0.15, speedup_vs_grouped_mm=1.0)]
    lines = decode.decode_table(rows).splitlines()
    assert lines[0].split("|")[6:9] == [" moeblaze_cudagraphs us ", " moeblaze_graph us ", " grouped_mm_compiled us "]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == ["s", "4", "3.00", "5.0", "6.0", "20.0", "12.0", "40.0", "50% (moeblaze_graph)", "3.33x", "-", "-"]


def test_table_keeps_the_bf16_floors_and_best_beside_the_fp8_peer():
    """The FP8 peer, the fastest and first here, is neither the bf16 floors' row nor the
    "moeblaze best": it has columns of its own, its floor and its share of it."""
    base = dict(shape="s", T=4, distinct_experts=3.0, floor_us_nominal=5.0, floor_us_measured=6.0)
    rows = [dict(base, peer="moeblaze_fp8_graph", floor_us_nominal=2.5, floor_us_measured=3.0, us=8.0,
                 share_of_floor_measured=0.375, speedup_vs_grouped_mm=5.0),
            dict(base, peer="moeblaze_graph", us=12.0, share_of_floor_measured=0.5, speedup_vs_grouped_mm=40 / 12),
            dict(base, peer="grouped_mm_compiled", us=40.0, share_of_floor_measured=0.15, speedup_vs_grouped_mm=1.0)]
    (cells,) = table_cells(decode.decode_table(rows), "s")
    assert cells["floor us (nominal)"] == "5.0" and cells["floor us (measured bw)"] == "6.0"
    assert cells["moeblaze best: share of measured floor"] == "50% (moeblaze_graph)"
    assert cells["vs grouped_mm"] == "3.33x" and cells["moeblaze_fp8_graph us"] == "8.0"
    assert cells["fp8 floor us (measured bw)"] == "3.0"
    assert cells["fp8: share of its floor"] == "38% (moeblaze_fp8_graph)"
    # Not timed: its floor stays, its share is "-".
    rows[0].update(us=float("nan"), share_of_floor_measured=float("nan"))
    (cells,) = table_cells(decode.decode_table(rows), "s")
    assert cells["moeblaze_fp8_graph us"] == "failed" and cells["fp8 floor us (measured bw)"] == "3.0"
    assert cells["fp8: share of its floor"] == "-"


FP8_SHAPE = "tiny_fp8_decode"
FP8_TOKENS = (1, 3)


@pytest.fixture
def fp8_shape(monkeypatch):
    """A decode shape whose widths are multiples of 128 (d=256, I=128), where the FP8 peers run."""
    monkeypatch.setitem(DECODE_SHAPES, FP8_SHAPE, (256, 128, 4, 2))
    return DECODE_SHAPES[FP8_SHAPE]


def fp8_bytes_per_expert(d, I):
    """e4m3 weights (1 byte an element) plus one fp32 scale per 128 x 128 block."""
    return 3 * d * I + 4 * ((2 * I // 128) * (d // 128) + (d // 128) * (I // 128))


def test_fp8_peer_rows_floor_and_weights_quantized_once_per_copy(tmp_path, fp8_shape, spied, monkeypatch, capsys):
    """moeblaze_fp8 runs where every width is a multiple of 128 (not at smoke_decode's d=64):
    timed, within FP8_TOLERANCE of grouped_mm but not equal to it, against a floor of its
    own bytes; the weights quantized once per copy, at setup, and never in a timed call."""
    quantized = dict(setup=[], in_peers=0, in_timing=0)
    state = dict(peers=False, timing=False)
    quantize_blocks, peers, time_per_call_us = moeblaze_ops.fp8.quantize_blocks, decode.peers, decode.time_per_call_us

    def quantize_spy(w, *args, **kwargs):
        out = quantize_blocks(w, *args, **kwargs)
        if state["timing"]:
            quantized["in_timing"] += 1
        elif state["peers"]:  # implementations.peers' own moeblaze_fp8, which decode drops
            quantized["in_peers"] += 1
        else:
            quantized["setup"].append(out)  # kept: no later tensor reuses its storage
        return out

    def during(key, fn):
        def spy(*args, **kwargs):
            state[key] = True
            try:
                return fn(*args, **kwargs)
            finally:
                state[key] = False
        return spy

    monkeypatch.setattr(moeblaze_ops.fp8, "quantize_blocks", quantize_spy)
    monkeypatch.setattr(decode, "peers", during("peers", peers))
    monkeypatch.setattr(decode, "time_per_call_us", during("timing", time_per_call_us))
    result = run_decode(tmp_path, "--nominal-tbps", "2.0", configs=("smoke_decode", FP8_SHAPE), tokens=FP8_TOKENS)
    rows = {(r["shape"], r["T"], r["peer"]): r for r in result["rows"]}
    assert set(rows) == ({(FP8_SHAPE, T, p) for T in FP8_TOKENS for p in ("moeblaze", "moeblaze_fp8", "grouped_mm")}
                         | {("smoke_decode", T, p) for T in FP8_TOKENS for p in ("moeblaze", "grouped_mm")})
    d, I, E, K = fp8_shape
    bandwidth = result["measured_tbps"] * 1e12
    for T in FP8_TOKENS:
        fp8_row = rows[(FP8_SHAPE, T, "moeblaze_fp8")]
        counts = fp8_row["distinct_experts_per_draw"]
        assert all(1 <= c <= min(E, T * K) for c in counts) and fp8_row["draws"] == len(counts)
        hit = sum(counts) / len(counts)
        fp8_moved = hit * fp8_bytes_per_expert(d, I) + 2 * T * d * 4
        assert fp8_row["floor_bytes"] == pytest.approx(fp8_moved)
        assert fp8_row["floor_us_nominal"] == pytest.approx(fp8_moved / 2.0e12 * 1e6)
        assert fp8_row["floor_us_measured"] == pytest.approx(fp8_moved / bandwidth * 1e6)
        assert math.isfinite(fp8_row["us"]) and fp8_row["us"] > 0 and "error" not in fp8_row
        assert fp8_row["share_of_floor_measured"] == pytest.approx(fp8_row["floor_us_measured"] / fp8_row["us"])
        assert fp8_row["share_of_floor_nominal"] == pytest.approx(fp8_row["floor_us_nominal"] / fp8_row["us"])
        assert 1e-3 < fp8_row["rel_err_vs_grouped_mm"] <= decode.FP8_TOLERANCE
        moved = hit * 3 * d * I * 4 + 2 * T * d * 4  # the fp32 layer's floor, as before
        for r in (rows[(FP8_SHAPE, T, "moeblaze")], rows[(FP8_SHAPE, T, "grouped_mm")]):
            assert r["distinct_experts_per_draw"] == counts and r["floor_bytes"] == pytest.approx(moved)
            assert r["floor_us_measured"] == pytest.approx(moved / bandwidth * 1e6)
            assert r["share_of_floor_measured"] == pytest.approx(r["floor_us_measured"] / r["us"])
    # Once per copy of the weights (gate_up and down): two calls a draw, for every T alike
    # (the draws of each T carry the same e4m3 tensors), none while timing.
    draws = spied["draws"][FP8_TOKENS[-1]]  # the last shape's: the FP8 one
    n_quantized = len(quantized["setup"])
    assert n_quantized == 2 * len(draws) and quantized["in_timing"] == 0
    made = [t for q in quantized["setup"] for t in (q.q, q.scale)]
    for T in FP8_TOKENS:
        for draw, first in zip(spied["draws"][T], draws, strict=True):
            fp8 = draw.fp8_inputs[3:]
            assert all(any(t is m for m in made) for t in fp8)
            assert all(a is b for a, b in zip(fp8, first.fp8_inputs[3:], strict=True))
            assert draw.w_gate_up8.dtype == moeblaze_ops.fp8.E4M3
    # The last moe_experts calls are moeblaze_fp8's timed ones (grouped_mm, last, calls HF's
    # code): on the draws' e4m3 weights, round the draws.
    assert spied["moeblaze_weights"][-4:] == [draws[i % len(draws)].w_gate_up8.data_ptr() for i in range(4)]
    cells = {c["T"]: c for c in table_cells(capsys.readouterr().out, FP8_SHAPE)}
    for T in FP8_TOKENS:
        fp8_row = rows[(FP8_SHAPE, T, "moeblaze_fp8")]
        assert cells[str(T)]["fp8 floor us (measured bw)"] == f"{fp8_row['floor_us_measured']:.1f}"
        assert cells[str(T)]["fp8: share of its floor"] == f"{fp8_row['share_of_floor_measured']:.0%} (moeblaze_fp8)"
        assert cells[str(T)]["floor us (measured bw)"] == f"{rows[(FP8_SHAPE, T, 'moeblaze')]['floor_us_measured']:.1f}"
        assert cells[str(T)]["moeblaze best: share of measured floor"].endswith("(moeblaze)")
    smoke = table_cells((tmp_path / "decode.md").read_text(), "smoke_decode")
    assert [(c["moeblaze_fp8 us"], c["fp8 floor us (measured bw)"], c["fp8: share of its floor"]) for c in smoke] \
        == [("-", "-", "-")] * len(FP8_TOKENS)


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


def test_skipped_fp8_peers_leave_no_rows(tmp_path, fp8_shape):
    """``--skip`` takes the FP8 peers' names in decode mode; skipped, an FP8 shape has no FP8
    rows and the table's FP8 columns read "-"."""
    result = run_decode(tmp_path, "--skip", "moeblaze_fp8", "moeblaze_fp8_graph", configs=(FP8_SHAPE,), tokens=(1,))
    assert {r["peer"] for r in result["rows"]} == {"moeblaze", "grouped_mm"}
    (cells,) = table_cells((tmp_path / "decode.md").read_text(), FP8_SHAPE)
    assert cells["fp8 floor us (measured bw)"] == cells["fp8: share of its floor"] == "-"


def test_fp8_graph_peer_stacks_the_fp8_layer_on_each_draws_e4m3_weights():
    """moeblaze_fp8_graph's stack (run eagerly on CPU tensors) runs the FP8 layer on the
    draws' e4m3 weights in turn: each layer's output is that draw's FP8 layer's, a few per
    cent from its float layer's."""
    weights = decode.make_weights(256, 128, 4, 2, torch.float32, "cpu", 0)
    draws = decode.build_draws(3, 2, weights, torch.float32, "cpu", 0, fp8=decode.quantize_weights(weights))
    outs = decode.stack_call("moeblaze_fp8_graph", draws, 3)()
    assert len(outs) == 3
    for i, out in enumerate(outs):
        x, ids, w, gate_up8, down8, gate_up_scale, down_scale = draws[i % 2].fp8_inputs
        ref = moeblaze_ops.moe_experts(x, ids, w, gate_up8, down8, w_gate_up_scale=gate_up_scale,
                                       w_down_scale=down_scale)
        assert rel_err(out, ref) == 0
        assert 1e-3 < rel_err(out, moeblaze_ops.moe_experts(*draws[i % 2].inputs)) < decode.FP8_TOLERANCE


def test_fp8_floor_and_draw_memory():
    """The FP8 floor's bytes a expert (e4m3 and block scales), where FP8 applies, and the
    memory cap counting the e4m3 copies held beside the bf16 ones."""
    assert decode.fp8_applies(256, 128) and decode.fp8_applies(4096, 14336)
    assert not decode.fp8_applies(64, 128) and not decode.fp8_applies(2880, 2880)
    assert decode.fp8_expert_bytes(4096, 14336) == fp8_bytes_per_expert(4096, 14336)
    assert decode.fp8_expert_bytes(256, 128) == 3 * 256 * 128 + 4 * 6
    # 40% of 300 MB holds three copies of 40 MB, two where each also holds 20 MB of e4m3.
    assert decode.draw_count(40 * 2**20, 50 * 2**20, 300 * 2**20) == 3
    assert decode.draw_count(20 * 2**20, 50 * 2**20, 300 * 2**20, held_bytes=60 * 2**20) == 2
