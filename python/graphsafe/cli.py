"""The `graphsafe` command: `graphsafe bench` and `graphsafe demo`."""

from __future__ import annotations

import argparse
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphsafe",
        description="Deterministic, CUDA-graph-capturable training steps for embedding-heavy models.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_bench(commands)
    _add_demo(commands)
    return parser


def _add_bench(commands) -> None:
    from .bench import suites

    bench = commands.add_parser(
        "bench",
        help="run benchmark suites (JSON lines, then a markdown table)",
        description=(
            "Run benchmark suites side by side with the PyTorch equivalents. Prints one JSON line per measurement "
            "as it goes (the first line describes the environment), then a markdown table per suite."
        ),
    )
    bench.add_argument(
        "--suite", action="append", choices=sorted(suites()), metavar="NAME",
        help=f"suite to run (repeatable; default: all). Known: {', '.join(sorted(suites()))}",
    )
    bench.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when usable, else cpu")
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=None, help="small sizes (default on cpu)")
    size.add_argument("--full", dest="quick", action="store_false", help="full sizes (default on cuda)")
    bench.add_argument(
        "--repeats", type=_positive_int,
        help="timed repeats per measurement (default: cuda 30, 20 quick; cpu 10 quick, 3 full)",
    )
    bench.add_argument("--json-out", metavar="FILE", help="also write the JSON lines to FILE")
    bench.add_argument("--seed", type=int, default=0, help="seed for indices and gradients (default 0)")
    bench.set_defaults(handler=_run_bench)


def _add_demo(commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="short demonstration: embedding backward three ways (time, accuracy, determinism, capture)",
        description="Embedding backward of a small table, graphsafe vs aten vs index_add, on cuda if usable.",
    )
    demo.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when usable, else cpu")
    demo.set_defaults(handler=_run_demo)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _run_bench(args: argparse.Namespace) -> int:
    from .bench import BenchOptions, run_bench

    options = BenchOptions(
        suites=args.suite or [], device=args.device, quick=args.quick, repeats=args.repeats,
        json_out=args.json_out, seed=args.seed,
    )
    return run_bench(options)


def _run_demo(args: argparse.Namespace) -> int:
    from .bench import run_demo

    return run_demo(args.device)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
