"""Rows of `graphsafe bench --suite optim`'s compare table measured in a given number of alternating rounds,
host-bound or not (a check of rows on the GPU machine, whose host speed drifts between and within runs).

python3 tools/time_compare_rounds.py [--rounds N] [label substring ...]
e.g. python3 tools/time_compare_rounds.py --rounds 3 "×200" prints, per row and method, the ms median of each
round and their median (graphsafe.bench.optim.measure_compare_case: the bench's harness, timer and methods)."""
import sys

import torch

from graphsafe.bench.harness import BenchContext
from graphsafe.bench.optim import compare_cases, measure_compare_case
from graphsafe.bench.timing import default_timer_config, measure_copy_bandwidth


def main(argv: list[str]) -> None:
    rounds = 3
    if argv[:1] == ["--rounds"]:
        rounds, argv = int(argv[1]), argv[2:]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = device.type != "cuda"
    timer = default_timer_config(device, quick)
    ctx = BenchContext(device, quick, timer, measure_copy_bandwidth(device, timer), emit=lambda record: None)
    cases = [c for c in compare_cases(quick) if not argv or any(text in c.label for text in argv)]
    print(f"copy bandwidth {ctx.copy_bw_gbps:.0f} GB/s; {rounds} rounds; ms median per round, then their median")
    for case in cases:
        for r in measure_compare_case(ctx, case, rounds):
            per_round = " ".join(f"{t:.3f}" for t in r.get("rounds", [r.get("ms_median", float("nan"))]))
            speedup = f"  × vs torch {r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else ""
            print(f"{case.label:22s} {r['method']:16s} {per_round}  median {r.get('ms_median', float('nan')):.3f} ms"
                  f"{speedup}  {r.get('error', '')}")


if __name__ == "__main__":
    main(sys.argv[1:])
