"""What a run prints on stderr while it measures: progress bars, each row as it lands, and
one-line notes. stdout carries only the tables, so it can be piped to a file."""

from __future__ import annotations

import json
import sys

__all__ = ["progress", "emit", "note"]


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def progress(items, desc):
    """``items`` under a tqdm bar on stderr, if tqdm is importable."""
    tqdm = _tqdm()
    return items if tqdm is None else tqdm(items, desc=desc, file=sys.stderr)


def note(line):
    """Prints one line on stderr, between redraws of the progress bar, not through it."""
    tqdm = _tqdm()
    if tqdm is None:
        print(line, file=sys.stderr, flush=True)
    else:
        tqdm.write(line, file=sys.stderr)


def emit(row):
    """Prints one measured row as JSON as it lands, so a run cut short still shows what it
    measured; returns the row."""
    note(json.dumps(row))
    return row
