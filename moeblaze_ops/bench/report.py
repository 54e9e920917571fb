"""What a run writes: markdown tables of the measured rows and the forward bar charts.

Each table compares every peer of a config at a token count T with that config's
``hf_grouped_mm_compiled`` row at the same T (HF's fastest backend); one without that row
shows "-" there. Each row shows its T and its routing's max/mean expert load beside the config.
"""

from __future__ import annotations

import math

__all__ = ["BASE_PEER", "LAYERS", "title", "layer", "routing", "forward_table", "train_table", "dispatch_table",
           "plot"]

BASE_PEER = "hf_grouped_mm_compiled"

#: The layer each variant (``configs.VARIANTS``) measures, as the tables' headings name it.
LAYERS = {
    "none": "SwiGLU",
    "bias": "SwiGLU with biases",
    "clamped": "GPT-OSS clamped SwiGLU, interleaved, with biases",
    "fp16": "SwiGLU, fp16",
}


def title(mode, device, torch_version, changes):
    """The markdown title of a run: its mode, device, torch and the settings it changed."""
    text = f"# moeblaze bench ({mode}) on {device}, torch {torch_version}"
    if changes:
        text += ", settings " + ", ".join(f"{k}={v!r}" for k, v in changes.items())
    return text


def layer(variant, dtype=None):
    """The layer of ``variant``, for a table's heading (``LAYERS``); with ``dtype`` (the
    forward heading names it first) "dtype, layer", the fp16 variant's dtype said once:
    "fp16, SwiGLU"."""
    if dtype is None:
        return LAYERS[variant]
    return "fp16, SwiGLU" if variant == "fp16" else f"{dtype}, {LAYERS[variant]}"


def routing(tilt, hot=0.0, empty=0):
    """The routing of a run with ``tilt``, ``hot`` and ``empty`` (``make_inputs``), for a
    table's heading: "uniform routing" when all are 0."""
    changes = []
    if tilt:
        changes.append(f"{'+' if tilt > 0 else '-'} {abs(tilt):g}*linspace(1, 0, E)")
    if hot:
        changes.append(f"{'+' if hot > 0 else '-'} {abs(hot):g} on expert 0")
    text = "router logits " + ", ".join(changes) if changes else "uniform routing"
    if empty:
        text += ", last expert empty" if empty == 1 else f", last {empty} experts empty"
    return text


def _against_base(rows, base_peer=BASE_PEER):
    """(the row's first cells: config, T, max/mean expert load; peer, row, the base row of
    its config and T or None, speed vs base as text), per row."""
    by = {}
    for r in rows:
        by.setdefault((r["config"], r["T"]), {})[r["peer"]] = r
    for (cfg, T), peers_ in by.items():
        base = peers_.get(base_peer)
        for peer, r in peers_.items():
            case = [cfg, str(T), f"{r['load_imbalance']:.2f}x"]
            yield case, peer, r, base, (f"{base['ms'] / r['ms']:.2f}x" if base else "-")


def _markdown(header, body):
    """A markdown table: ``header`` cells, then one row of cells per item of ``body``."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def _ratio(r, base, key):
    return f"{r[key] / base[key]:.2f}x" if base and base[key] > 0 and not math.isnan(r[key]) else "-"


def _num(value, digits):
    """A measured number, or "-" where it was not measured (NaN)."""
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


#: The cells ``_against_base`` gives each row before its peer's.
_CASE_HEADER = ["config", "T", "max/mean expert load"]


def forward_table(rows):
    """Markdown table of ``bench_forward``'s rows."""
    header = [*_CASE_HEADER, "peer", "ms", "TFLOP/s", "peak GB (no grad)", "peak GB (training fwd)",
              "speed vs compiled grouped_mm", "peak vs compiled grouped_mm (no grad / training fwd)"]
    return _markdown(header, (
        [*case, peer, f"{r['ms']:.3f}", f"{r['tflops']:.0f}", _num(r['peak_gb'], 2), _num(r['train_fwd_peak_gb'], 2),
         speed, f"{_ratio(r, base, 'peak_gb')} / {_ratio(r, base, 'train_fwd_peak_gb')}" if base and base["peak_gb"] > 0
         else "-"]
        for case, peer, r, base, speed in _against_base(rows)))


def train_table(rows):
    """Markdown table of ``bench_train``'s rows."""
    header = [*_CASE_HEADER, "peer", "fwd+bwd ms", "TFLOP/s", "activation GB", "peak GB",
              "speed vs compiled grouped_mm", "activation vs compiled grouped_mm", "peak vs compiled grouped_mm",
              "peak GB, accumulating"]
    return _markdown(header, (
        [*case, peer, f"{r['ms']:.3f}", f"{r['tflops']:.0f}", _num(r['activation_gb'], 3), _num(r['peak_gb'], 2), speed,
         _ratio(r, base, "activation_gb"), _ratio(r, base, "peak_gb"), _num(r['accumulate_peak_gb'], 2)]
        for case, peer, r, base, speed in _against_base(rows)))


def dispatch_table(rows):
    """Markdown table of ``bench_dispatch``'s rows; with CUDA-graph times when they have them."""
    graphs = bool(rows) and "sort_histc_cumsum_graph_ms" in rows[0]
    header = ["L", "K", "E", "sort+histc+cumsum ms", "moeblaze kernels ms", "moeblaze op ms (with id checks)",
              "speedup (kernels / op)"]
    if graphs:
        header += ["CUDA graph: sort+histc+cumsum ms", "kernels ms", "op ms", "speedup (kernels / op)"]

    def cells(r):
        out = [str(r["L"]), str(r["K"]), str(r["E"])]
        for suffix in ("", "_graph") if graphs else ("",):
            out += [f"{r[f'sort_histc_cumsum{suffix}_ms']:.3f}", f"{r[f'moeblaze_kernels{suffix}_ms']:.3f}",
                    f"{r[f'moeblaze_op{suffix}_ms']:.3f}",
                    f"{r[f'speedup_kernels{suffix}']:.1f}x / {r[f'speedup_op{suffix}']:.1f}x"]
        return out

    return _markdown(header, (cells(r) for r in rows))


def plot(rows, path):
    """Bar charts of the forward rows' TFLOP/s and peak memory per config, T and peer, saved
    to ``path``; False (nothing written) where matplotlib is not importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = list(dict.fromkeys((r["config"], r["T"]) for r in rows))
    peers_ = list(dict.fromkeys(r["peer"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.8 / len(peers_)
    for i, p in enumerate(peers_):
        vals = {(r["config"], r["T"]): r for r in rows if r["peer"] == p}
        xs = [j + i * width for j in range(len(cases))]
        axes[0].bar(xs, [vals[c]["tflops"] if c in vals else 0 for c in cases], width, label=p)
        axes[1].bar(xs, [vals[c]["peak_gb"] if c in vals else 0 for c in cases], width, label=p)
    for ax, name in zip(axes, ["forward TFLOP/s", "forward peak memory (GB)"]):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))],
                      [f"{cfg} T={T}" for cfg, T in cases], rotation=30)
        ax.set_title(name)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
