"""The benchmark's own smoke run on CPU: its activation-memory measurement is exact."""

import json

from moeblaze_ops.bench import CONFIGS, main


def test_train_smoke_measures_what_backward_keeps(tmp_path):
    main(["--device", "cpu", "--mode", "train", "--configs", "smoke", "--out", str(tmp_path),
          "--skip", "hf_eager", "hf_grouped_mm_compiled", "moeblaze_compiled"])
    result = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["peer"]: r for r in result["train"]}
    assert set(rows) == {"hf_grouped_mm", "moeblaze", "moeblaze_recompute", "moeblaze_recompute_compiled"}
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
    assert (tmp_path / "bench.md").read_text().count("| smoke |") == 4


def test_no_forward_rows_writes_tables_without_a_plot(tmp_path):
    """`--configs` with no names (the dispatch micro-benchmark alone) has no forward rows to
    plot: the run still writes its files."""
    main(["--device", "cpu", "--configs", "--no-dispatch", "--out", str(tmp_path)])
    assert (tmp_path / "bench.md").exists() and not (tmp_path / "forward.png").exists()
