"""The benchmark of moeblaze against HF transformers' experts backends.

Run it as ``python -m moeblaze_ops.bench`` (``--help`` lists the options). Its parts:

- ``configs``: the layer shapes measured (``CONFIGS``, ``DECODE_SHAPES``, ``DISPATCH_CASES``) and ``make_inputs``;
- ``implementations``: the peers compared, each a callable on one config's inputs (``peers``);
- ``measure``: time, peak and activation memory per peer, and the dispatch micro-benchmark;
- ``report``: the markdown tables and the forward bar charts;
- ``decode``: decode mode, the forward at inference token counts beside its memory floor;
- ``cli``: the command line, which runs the measurements under the kernel settings it is given;
- ``expert_parallel``: expert parallelism against one device, a command of its own
  (``torchrun --nproc-per-node N -m moeblaze_ops.bench.expert_parallel``; not imported here).
"""

from .cli import main
from .configs import CONFIGS, DISPATCH_CASES, make_inputs
from .implementations import peers
from .measure import BenchContext, activation_bytes, peak_bytes, time_ms

__all__ = ["CONFIGS", "DISPATCH_CASES", "BenchContext", "activation_bytes", "main", "make_inputs", "peak_bytes",
           "peers", "time_ms"]
