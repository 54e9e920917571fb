"""Entry point of ``python -m moeblaze_ops.bench`` (see ``moeblaze_ops.bench.cli``)."""

from .cli import main

main()
