"""The progress display of ``ortbatch run``: rows/s, tokens/s, ETA and errors, as a bar on a
terminal or a plain line every few seconds otherwise (both engines)."""

from __future__ import annotations

import time
from typing import TextIO

from .plan import Prepared

__all__ = ["Progress", "make_progress"]


class Progress:
    """Rows/s, tokens/s, ETA and errors: a bar redrawn in place on a terminal, otherwise a
    plain line every ``every_s`` seconds."""

    def __init__(self, total: int | None, done: int, stream: TextIO, tty: bool, every_s: float, enabled: bool) -> None:
        self.total, self.start_rows = total, done
        self.stream, self.tty, self.every_s, self.enabled = stream, tty, every_s, enabled
        self.t0 = self.last = time.monotonic()
        self.rows = done
        self.tokens = 0
        self.errors = 0

    def update(self, rows: int, tokens: int, errors: int) -> None:
        self.rows += rows
        self.tokens += tokens
        self.errors += errors
        now = time.monotonic()
        if self.enabled and (self.tty or now - self.last >= self.every_s):
            self.last = now
            self._show(now)

    def _show(self, now: float, final: bool = False) -> None:
        dt = max(now - self.t0, 1e-9)
        rate = (self.rows - self.start_rows) / dt
        parts = [f"{self.rows}" + (f"/{self.total}" if self.total else "") + " rows"]
        parts += [f"{rate:.0f} rows/s", f"{self.tokens / dt:.0f} tokens/s"]
        if self.total and rate > 0 and not final:
            parts.append(f"ETA {_duration(max(self.total - self.rows, 0) / rate)}")
        parts.append(f"{self.errors} errors")
        text = ", ".join(parts)
        if self.tty:
            bar = ""
            if self.total:
                filled = int(30 * min(self.rows / self.total, 1.0))
                bar = "[" + "#" * filled + "." * (30 - filled) + "] "
            self.stream.write("\r" + bar + text + ("\n" if final else ""))
        else:
            self.stream.write("ortbatch run: " + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self._show(time.monotonic(), final=True)


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def make_progress(prepared: Prepared, done_rows: int, stream: TextIO, total: int | None = None) -> Progress:
    """The progress display for a job with ``done_rows`` rows already committed (``total``:
    the input's rows when known, else counted when that is cheap)."""
    config = prepared.config
    tty = bool(getattr(stream, "isatty", lambda: False)())
    enabled = config.progress is not False
    rows = total if total is not None else prepared.source.count()
    return Progress(rows, done_rows, stream, tty, config.progress_every_s, enabled)
