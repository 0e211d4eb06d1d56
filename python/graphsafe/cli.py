"""The `graphsafe` command: `graphsafe train`, `graphsafe bench` and `graphsafe demo`."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, NoReturn, Sequence


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="graphsafe",
        description="Deterministic, CUDA-graph-capturable training steps for embedding-heavy models.",
    )
    parser.add_argument("--version", action="version", version=f"graphsafe {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_train(commands)
    _add_bench(commands)
    _add_demo(commands)
    return parser


def _add_train(commands) -> None:
    from .trainer.run import MATMUL_PRECISIONS, MIN_VOCAB, OPTIMIZERS, SEED_RANGE, SIZES

    cpu, cuda = SIZES["cpu"], SIZES["cuda"]
    train = commands.add_parser(
        "train",
        help="train a demo model with graphsafe.compile_step (trace, rewrite, gate, capture) and report",
        description=(
            "Train an embedding-heavy demo model (plain torch.nn.Embedding) on synthetic data from a seed, through "
            "graphsafe.compile_step: the step is traced, aten's embedding backward rewritten to graphsafe's, checked "
            "by the capture gate and captured in CUDA graphs where possible. Prints progress, then a summary table. "
            f"Default sizes: cpu dim {cpu['dim']}, {cpu['layers']} layers, seq {cpu['seq_len']}, batch "
            f"{cpu['batch_size']}, {cpu['steps']} steps; cuda dim {cuda['dim']}, {cuda['layers']} layers, seq "
            f"{cuda['seq_len']}, batch {cuda['batch_size']}, {cuda['steps']} steps; vocabulary 32768 on both."
        ),
    )
    train.add_argument("--model", choices=("lm", "recsys"), default="lm",
                       help="lm: small transformer LM (default); recsys: recommender with large embedding tables")
    train.add_argument("--moe", action="store_true", help="lm: a top-1 mixture-of-experts layer (half the experts start cold)")
    train.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw", help="graphsafe optimizer (default adamw)")
    train.add_argument("--lr", type=_positive_float, help="learning rate (default: per optimizer, see trainer/run.py)")
    train.add_argument("--state-bits", type=int, choices=(32, 16, 8), default=32, help="optimizer state bits (default 32)")
    train.add_argument("--skip-zeros", action="store_true", help="leave elements with an exactly-zero gradient untouched")
    train.add_argument("--sparse-updates", action=argparse.BooleanOptionalAction, default=True,
                       help="step embedding tables row-sparse (their dense gradient never built, same result bitwise) "
                            "where the table's optimizer group has skip_zeros (default on). recsys: the tables get "
                            "a param group with skip_zeros=True for it (untouched rows keep their values and states); "
                            "lm: applies with --skip-zeros. --no-sparse-updates: dense gradients, and recsys tables "
                            "follow --skip-zeros")
    train.add_argument("--mode", choices=("auto", "full", "piecewise", "eager"), default="auto",
                       help="capture mode (default auto: full if the gate passes, else piecewise, else eager)")
    train.add_argument("--steps", type=_positive_int, help="training steps (default: cpu 30, cuda 200)")
    train.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when usable, else cpu")
    train.add_argument("--seed", type=_seed(*SEED_RANGE), default=0,
                       help="seed for the model, the data and the chain (default 0)")
    train.add_argument("--batch-size", type=_positive_int, help="sequences (lm) or rows (recsys) per step")
    train.add_argument("--seq-len", type=_positive_int, help="lm sequence length")
    train.add_argument("--vocab", type=_int_at_least(MIN_VOCAB),
                       help=f"lm vocabulary / recsys item count (default 32768, at least {MIN_VOCAB})")
    train.add_argument("--dim", type=_positive_int, help="model width")
    train.add_argument("--layers", type=_positive_int, help="lm transformer blocks")
    train.add_argument("--matmul", choices=MATMUL_PRECISIONS,
                       help=f"how CUDA runs fp32 matrix products, for every method compared (default "
                            f"{cuda['matmul']}; tf32 is deterministic too; no effect on the cpu)")
    train.add_argument("--check-determinism", action="store_true",
                       help="train twice from the seed and compare the final parameters bitwise")
    train.add_argument("--compare-torch", action="store_true",
                       help="also time a plain eager PyTorch loop (torch.nn.Embedding, torch.optim.AdamW, fused on cuda)")
    train.add_argument("--nproc", type=_positive_int,
                       help="train data-parallel in N local processes started here (gloo on cpu, NCCL on cuda with one "
                            "GPU per rank); or run under torchrun instead (docs/multi-gpu.md)")
    train.add_argument("--plot", metavar="FILE", type=_writable_file,
                       help="also draw the loss and step time per step of each method run as FILE (.png, .svg or "
                            ".pdf; needs matplotlib: pip install 'graphsafe[plot]')")
    train.add_argument("--parallel", choices=("none", "ddp", "fsdp2"),
                       help="data parallelism across the processes: ddp (gradient all-reduce inside the compiled step; "
                            "the default with several processes) or fsdp2 (fully_shard, run eagerly)")
    train.set_defaults(handler=_run_train, parser=train)


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
    bench.add_argument("--json-out", metavar="FILE", type=_writable_file, help="also write the JSON lines to FILE")
    bench.add_argument("--seed", type=_seed(0, 2**32 - 1), help="seed for indices and gradients (default 0)")
    bench.add_argument("--plot", metavar="DIR", type=_folder,
                       help="also draw each suite's results as DIR/<suite>.png (embedding, optim; made if missing; "
                            "needs matplotlib: pip install 'graphsafe[plot]')")
    bench.add_argument("--from", dest="from_file", metavar="FILE", type=_readable_file,
                       help="with --plot: draw the plots from FILE, the JSON lines of an earlier run (--json-out, or "
                            "its whole stdout), instead of measuring")
    bench.set_defaults(handler=_run_bench, parser=bench)


def _add_demo(commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="short demonstration: embedding backward three ways (time, accuracy, determinism, capture)",
        description="Embedding backward of a small table, graphsafe vs aten vs index_add, on cuda if usable.",
    )
    demo.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when usable, else cpu")
    demo.set_defaults(handler=_run_demo, parser=demo)


# Argument converters. argparse names a converter by its __name__ in "invalid <name> value" messages, so each
# raises ArgumentTypeError with its own wording instead.

def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {what} value: {text!r}") from None


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        value = _integer(text, "integer")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    convert.__name__ = f"integer >= {minimum}"
    return convert


def _positive_int(text: str) -> int:
    value = _integer(text, "positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _seed(low: int, high: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        value = _integer(text, "seed")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {value}")
        return value

    convert.__name__ = "seed"
    return convert


def _writable_file(text: str) -> str:
    """FILE to write (--json-out, train's --plot): its folder must exist (checked now, not after a run)."""
    folder = os.path.dirname(os.path.abspath(text)) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {folder!r} does not exist")
    return text


def _folder(text: str) -> str:
    """DIR for bench's --plot: a folder, or a path where one can be made."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    return text


def _readable_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file" if os.path.exists(text) else f"no file {text!r}")
    return text


def _run_bench(args: argparse.Namespace) -> int:
    from .bench import BenchOptions, run_bench
    from .bench.plots import PlotUnavailable

    if args.from_file is not None:
        if args.plot is None:
            args.parser.error("--from FILE draws the plots of a saved run: give --plot DIR too")
        measuring = [option for option, value in (("--device", args.device), ("--quick/--full", args.quick),
                                                  ("--repeats", args.repeats), ("--json-out", args.json_out),
                                                  ("--seed", args.seed)) if value is not None]
        if measuring:
            args.parser.error(f"--from plots a saved run without measuring; {', '.join(measuring)} would not apply")
    options = BenchOptions(
        suites=args.suite or [], device=args.device, quick=args.quick, repeats=args.repeats,
        json_out=args.json_out, seed=args.seed or 0, plot_dir=args.plot, from_file=args.from_file,
    )
    try:
        return run_bench(options)
    except PlotUnavailable as exc:
        _missing_plot_library(args, exc)


def _missing_plot_library(args: argparse.Namespace, exc: ImportError) -> NoReturn:
    """Exit with one line that says how to install matplotlib (a missing extra, not a usage error: exit code 1)."""
    args.parser.exit(1, f"{args.parser.prog}: error: --plot: {exc}\n")


def _run_train(args: argparse.Namespace) -> int:
    from .bench.harness import resolve_device
    from .bench.plots import PlotUnavailable, require_matplotlib
    from .trainer import default_config, train
    from .trainer.run import ConfigError, check_config

    device = resolve_device(args.device)
    nproc, parallel = _processes(args, device)
    config = default_config(
        str(device), model=args.model, moe=args.moe, optimizer=args.optimizer, lr=args.lr, state_bits=args.state_bits,
        skip_zeros=args.skip_zeros, sparse_updates=args.sparse_updates, mode=args.mode, steps=args.steps, seed=args.seed, batch_size=args.batch_size,
        seq_len=args.seq_len, vocab=args.vocab, dim=args.dim, layers=args.layers, matmul=args.matmul,
        check_determinism=args.check_determinism, compare_torch=args.compare_torch, parallel=parallel, plot=args.plot,
    )
    try:
        check_config(config)
    except ConfigError as exc:
        args.parser.error(str(exc))
    if args.plot is not None:
        try:  # before the training, and before --nproc starts its processes
            require_matplotlib()
        except PlotUnavailable as exc:
            _missing_plot_library(args, exc)
    if nproc > 1:
        from .trainer.parallel import launch

        # The ranks parse the same arguments (the last --parallel and --device win), and know from their
        # environment that they are ranks of this launch.
        return launch(nproc, [*args.argv, "--parallel", parallel, "--device", device.type])
    try:
        train(config)  # the result (models, steps) is dropped here, before the process group is left
    except (MemoryError, RuntimeError) as exc:  # check_config's memory estimate is only a lower bound
        if not _out_of_memory(exc):
            raise
        args.parser.exit(1, f"{args.parser.prog}: error: out of memory on {device} ({_first_line(exc)}); "
                            "try smaller sizes (--vocab, --dim, --batch-size, --seq-len)\n")
    if parallel != "none":  # not after a failure: the other ranks may never reach the barrier finish() waits at
        import gc

        from .trainer.parallel import finish

        gc.collect()
        finish()
    return 0


def _processes(args: argparse.Namespace, device) -> tuple[int, str]:
    """(processes to start here, parallel mode) from --nproc, --parallel and the environment: 1 when this process is
    a rank already (torchrun, or a rank of --nproc) or runs alone."""
    from .trainer.parallel import fsdp2_available, under_launcher

    parallel = args.parallel
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        if args.nproc is not None and os.environ.get("GRAPHSAFE_LAUNCHED") != "1":
            args.parser.error("--nproc starts the processes itself; under torchrun leave it out "
                              "(torchrun's --nproc-per-node sets the number of processes)")
        if parallel == "none" and world > 1:
            args.parser.error(f"--parallel none in a world of {world} processes would train {world} independent "
                              "copies; use --parallel ddp or fsdp2")
        return 1, parallel or "ddp"
    nproc = args.nproc or 1
    if parallel is None:
        parallel = "ddp" if nproc > 1 else "none"
    if parallel == "none" and nproc > 1:
        args.parser.error(f"--nproc {nproc} with --parallel none would train {nproc} independent copies; use "
                          "--parallel ddp or fsdp2")
    if parallel != "none":
        import torch.distributed as dist

        backend_ok = dist.is_available() and (dist.is_nccl_available() if device.type == "cuda"
                                              else dist.is_gloo_available())
        if not backend_ok:
            args.parser.error(f"--parallel {parallel} on {device.type} needs torch.distributed with the "
                              f"{'nccl' if device.type == 'cuda' else 'gloo'} backend, which this torch lacks")
        if parallel == "fsdp2" and not fsdp2_available():
            args.parser.error("--parallel fsdp2 needs torch.distributed.fsdp.fully_shard (FSDP2), which this torch lacks")
    if device.type == "cuda" and nproc > 1:
        import torch

        count = torch.cuda.device_count()
        if nproc > count:
            args.parser.error(f"--nproc {nproc} on cuda needs one GPU per process, but {count} are visible")
    return nproc, parallel


def _out_of_memory(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(exc)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _run_demo(args: argparse.Namespace) -> int:
    from .bench import run_demo

    return run_demo(args.device)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print(f"\n{args.parser.prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
