"""Where the dispatch's device time goes, kernel by kernel, at the benchmark's dispatch
sizes (CUDA): the checked kernels the op runs (``triton_dispatch.dispatch_checked``)
beside the sort + histc + cumsum baseline, under ``torch.profiler``.

    python3 scripts/profile_dispatch.py [--calls 20] [--set dispatch_sort_chunk=1024]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from moeblaze_ops import settings
from moeblaze_ops.bench.cli import parse_setting
from moeblaze_ops.bench.configs import DISPATCH_CASES
from moeblaze_ops.bench.measure import sort_histc_cumsum
from moeblaze_ops.kernels import triton_dispatch


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--set", dest="settings", metavar="NAME=VALUE", action="append", type=parse_setting, default=[],
                   help="change a kernel setting for the run (repeatable)")
    a = p.parse_args()
    with settings.override(**dict(a.settings)):
        for L, K, E in DISPATCH_CASES:
            ids = torch.randn(L, E, device="cuda").topk(K, dim=-1).indices
            for name, fn in (("moeblaze (checked kernels)", lambda: triton_dispatch.dispatch_checked(ids, E)),
                             ("sort + histc + cumsum", lambda: sort_histc_cumsum(ids, E))):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(a.calls):
                        fn()
                    torch.cuda.synchronize()
                events = [e for e in prof.key_averages() if e.device_time_total > 0]
                total = sum(e.self_device_time_total for e in events) / a.calls
                print(f"\n(L={L}, K={K}, E={E}) {name}: {total:.1f} us of device time a call")
                for e in sorted(events, key=lambda e: -e.self_device_time_total)[:8]:
                    print(f"  {e.self_device_time_total / a.calls:8.1f} us  {e.count // a.calls} x  {e.key[:80]}")


if __name__ == "__main__":
    main()
