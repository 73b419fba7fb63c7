"""A progress line on stderr for long work (tuning a network's layers, populating the cache).

On a terminal the line is rewritten in place: `[#####-----] 12/50 label`. Into a file or a pipe it
writes whole lines instead: one per step, or, with `quiet_steps`, one per tenth of the work, so a
log keeps a trace without a line per layer.
"""

from __future__ import annotations

import sys

BAR_WIDTH = 24


class Progress:
    def __init__(self, total: int, stream=None, quiet_steps: bool = False):
        self._stream = stream or sys.stderr
        self._total = total
        self._width = len(str(total))
        self._interactive = self._stream.isatty()
        self._quiet_steps = quiet_steps
        self._shown = 0
        self._last_tenth = -1

    def tag(self, index: int) -> str:
        return f"[{index:>{self._width}}/{self._total}]"

    def _bar(self, index: int) -> str:
        filled = BAR_WIDTH * index // max(self._total, 1)
        return f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {index:>{self._width}}/{self._total}"

    def show(self, index: int, label: str) -> None:
        if self._interactive:
            text = f"{self._bar(index) if self._quiet_steps else self.tag(index)} {label}"
            self._stream.write("\r" + text.ljust(self._shown))
            self._shown = len(text)
        elif self._quiet_steps:
            tenth = 10 * index // max(self._total, 1)
            if tenth == self._last_tenth:
                return
            self._last_tenth = tenth
            self._stream.write(f"{self.tag(index)} {label}\n")
        else:
            self._stream.write(f"{self.tag(index)} {label}\n")
        self._stream.flush()

    def clear(self) -> None:
        """Blank the in-place line so a result line printed next starts clean."""
        if self._interactive and self._shown:
            self._stream.write("\r" + " " * self._shown + "\r")
            self._stream.flush()
            self._shown = 0
