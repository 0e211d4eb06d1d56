"""The 8-bit rows of `graphsafe bench --suite optim` alone (a quick check while tuning the 8-bit kernels on
the GPU machine): python3 tools/time_optim8.py [--all-algorithms]."""
import sys

import torch

from graphsafe.bench.harness import BenchContext
from graphsafe.bench.optim import eight_bit_cases, measure_method
from graphsafe.bench.timing import default_timer_config, measure_copy_bandwidth

device = torch.device("cuda")
timer = default_timer_config(device, quick=False)
ctx = BenchContext(device, False, timer, measure_copy_bandwidth(device, timer), emit=lambda record: None)
cases = eight_bit_cases(False)
if "--all-algorithms" not in sys.argv:
    cases = [c for c in cases if c.algorithm == "AdamW"]
print(f"copy bandwidth {ctx.copy_bw_gbps:.0f} GB/s")
for case in cases:
    r = measure_method(ctx, case, "graphsafe")
    print(f"{case.label:30s} {r.get('ms_median', float('nan')):7.3f} ms  {r.get('pct_copy_bw', 0):5.1f}% copy BW"
          f"  {r.get('error', '')}")
