"""The training loop's progress display, drawn by tqdm.

On a terminal: tqdm's bar, rewritten in place, with the latest loss and step time. Anywhere else (a pipe, a CI
or device log, a test's captured output): one plain line per step, which logs and tests can read; tqdm's bar
would write a carriage-return update at every refresh there instead.
"""

from __future__ import annotations

import os
import sys


class Progress:
    """show(i, loss, ms) for the training loop; a context manager, so the bar is closed however the loop ends."""

    def __init__(self, steps: int, stream=None) -> None:
        from tqdm import tqdm  # here, not at import: every graphsafe command imports the trainer, few show progress

        self.steps = steps
        self.stream = stream if stream is not None else sys.stdout
        terminal = _is_terminal(self.stream)
        # tqdm follows the terminal's size; on one that reports none (a pseudo-terminal nobody sized, as some
        # containers give) it would draw nothing, so that one is taken as 80 x 24.
        sized = terminal and _columns(self.stream) > 0
        self.bar = tqdm(total=steps, desc="train", unit="step", file=self.stream, disable=not terminal,
                        dynamic_ncols=sized, **({} if sized else dict(ncols=80, nrows=24)))

    def __call__(self, i: int, loss: float, ms: float) -> None:
        if self.bar.disable:
            print(f"step {i:>5}/{self.steps}  loss {loss:8.4f}  {ms:8.2f} ms", file=self.stream, flush=True)
            return
        self.bar.set_postfix_str(f"loss {loss:.4f}, {ms:.2f} ms", refresh=False)
        self.bar.update(1)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.bar.close()


def _is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0
