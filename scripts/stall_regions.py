"""Where a warp-specialised Gluon kernel's warps wait: Nsight Compute's warp-stall samples
by SASS line, summed over the kernel's regions.

The input is the CSV of ncu's source page (``--section SourceCounters``, then
``ncu -i REPORT --page source --csv --print-source sass > FILE``). The regions follow the
SASS of the kernels that ``gluon_row_gemm.ws_tile_steps`` drives (the row GEMM, dH, the
weight gradients):

- the copy warps: from the start to the first ``EXIT`` (their partition's code comes first);
- the MMA warps before their loop: to the CTA barrier ahead of the first ring wait
  (``SYNCS.PHASECHK``) that precedes the first wgmma (``HGMMA``);
- their reduction steps: from there to the first wait for every wgmma
  (``WARPGROUP.DEPBAR.LE gsb0, 0x0``);
- their epilogue: from there to the last ring-slot release (``SYNCS.ARRIVE...A1T0``);
- the rest: the kernel's exit and the out-of-line retry loops of mbarrier waits.

Each region's share of all samples, and its most frequent stall reasons::

    python3 scripts/stall_regions.py FILE.csv [--opcodes]
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
from typing import Dict, List, NamedTuple


class Line(NamedTuple):
    """One SASS line: its text, its stall samples and their split by reason."""

    source: str
    samples: int
    reasons: Dict[str, int]


class Region(NamedTuple):
    name: str
    start: int  # the first line's index
    end: int  # one past the last


def read_source_csv(path: str) -> List[Line]:
    """The SASS lines of ncu's source-page CSV (a kernel-name row, then the header)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(row for row in rows if "Source" in row)
    source, samples = header.index("Source"), header.index("Warp Stall Sampling (All Samples)")
    reasons = {i: name[len("stall_"):] for i, name in enumerate(header)
               if name.startswith("stall_") and "Not Issued" not in name}
    lines = []
    for row in rows[rows.index(header) + 1:]:
        if len(row) < len(header) or not row[samples].strip().isdigit():
            continue
        lines.append(Line(row[source].strip(), int(row[samples]),
                          {name: int(row[i] or 0) for i, name in reasons.items()}))
    return lines


def regions(lines: List[Line]) -> List[Region]:
    """The kernel's regions (see the module's docstring), from the markers in its SASS."""
    text = [line.source for line in lines]

    def first(pattern, start=0):
        return next(i for i in range(start, len(text)) if re.search(pattern, text[i]))

    copy_end = first(r"\bEXIT\b") + 1
    mma = first(r"\bHGMMA\b", copy_end)
    ring_wait = max(i for i in range(copy_end, mma) if "SYNCS.PHASECHK" in text[i])
    loop = max(i for i in range(copy_end, ring_wait) if "BAR.SYNC" in text[i])
    epilogue = first(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", mma)
    epilogue_end = max(i for i, t in enumerate(text) if re.search(r"SYNCS\.ARRIVE\S*A1T0", t)) + 1
    return [Region("copy warps", 0, copy_end), Region("MMA warps before their loop", copy_end, loop),
            Region("MMA warps: reduction steps", loop, epilogue), Region("MMA warps: epilogue", epilogue, epilogue_end),
            Region("rest (exit, wait retries)", epilogue_end, len(lines))]


def summarize(lines: List[Line], top: int = 6) -> List[str]:
    """One line per region: its share of all samples and its top stall reasons."""
    total = sum(line.samples for line in lines) or 1
    out = []
    for region in regions(lines):
        part = lines[region.start:region.end]
        samples = sum(line.samples for line in part)
        reasons = collections.Counter()
        for line in part:
            reasons.update(line.reasons)
        split = ", ".join(f"{name} {100 * n / max(samples, 1):.0f}%" for name, n in reasons.most_common(top))
        out.append(f"{region.name:28s} {100 * samples / total:5.1f}% of samples; {split}")
    return out


def epilogue_opcodes(lines: List[Line], top: int = 20) -> str:
    """The epilogue's samples by opcode (share, and how many lines of it)."""
    region = next(r for r in regions(lines) if r.name == "MMA warps: epilogue")
    samples, count = collections.Counter(), collections.Counter()
    for line in lines[region.start:region.end]:
        opcode = re.sub(r"^@!?U?P\w+\s+", "", line.source).split(" ")[0].split(".")[0]
        samples[opcode] += line.samples
        count[opcode] += 1
    total = sum(samples.values()) or 1
    return ", ".join(f"{op} {100 * n / total:.1f}% ({count[op]})" for op, n in samples.most_common(top))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="+", help="ncu source-page CSV files (one kernel each)")
    parser.add_argument("--opcodes", action="store_true", help="also the epilogue's samples by opcode")
    args = parser.parse_args()
    for path in args.csv:
        lines = read_source_csv(path)
        print(path)
        for row in summarize(lines):
            print("  " + row)
        if args.opcodes:
            print("  epilogue by opcode: " + epilogue_opcodes(lines))


if __name__ == "__main__":
    main()
