"""Rows of `graphsafe bench --suite optim`'s compare table measured again in alternating rounds (a check of
host-bound rows on the GPU machine, whose host speed drifts between and within runs: the bench measures each
row's methods back to back, once).

python3 tools/time_compare_rounds.py [--rounds N] [label substring ...]
e.g. python3 tools/time_compare_rounds.py --rounds 3 "×200" prints, per row and method, the ms median of each
round (the same harness and timer as the bench: graphsafe, torch's fused step, and on bf16 rows graphsafe with
bf16 states), torch's and graphsafe's runs alternating, and the median over rounds."""
import statistics
import sys

import torch

from graphsafe.bench.harness import BenchContext
from graphsafe.bench.optim import SAME_STORAGE_METHOD, compare_cases, measure_method
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
        methods = ["torch", "graphsafe"] + ([SAME_STORAGE_METHOD] if case.dtype != torch.float32 else [])
        times: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(rounds):
            for method in methods if r % 2 == 0 else reversed(methods):
                record = measure_method(ctx, case, method)
                times[method].append(record.get("ms_median", float("nan")))
        torch_ms = statistics.median(times["torch"])
        for method in methods:
            ms = statistics.median(times[method])
            rounds_text = " ".join(f"{t:.3f}" for t in times[method])
            print(f"{case.label:22s} {method:16s} {rounds_text}  median {ms:.3f} ms  × vs torch {torch_ms / ms:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
