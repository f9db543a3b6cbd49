"""The progress display of ``ortbatch run``: rows/s, tokens/s, ETA and errors, as a bar on a
terminal or a plain line every few seconds otherwise (both engines)."""

from __future__ import annotations

import threading
import time
from typing import TextIO

from .plan import Prepared

__all__ = ["Progress", "make_progress"]

_REDRAW_S = 0.2  # a terminal bar: redrawn at most this often


class Progress:
    """Rows/s, tokens/s, ETA and errors: a bar redrawn in place on a terminal (at most
    ``_REDRAW_S`` apart), otherwise a plain line every ``every_s`` seconds; both from the
    first batch computed, not the first window committed (a window is thousands of rows).

    :meth:`advance` counts rows as their batches finish (not yet committed: a kill loses
    them); :meth:`update` counts a committed window, replacing what ``advance`` counted of it.
    """

    def __init__(self, total: int | None, done: int, stream: TextIO, tty: bool, every_s: float, enabled: bool) -> None:
        self.total, self.start_rows = total, done
        self.stream, self.tty, self.every_s, self.enabled = stream, tty, every_s, enabled
        self.t0 = time.monotonic()
        self.last: float | None = None  # when a line was last shown (None: never)
        self.rows = done  # committed (resumed ones included) + computed in the open window
        self.tokens = 0
        self.errors = 0
        self._open_rows = self._open_tokens = 0  # counted by advance() in the window not committed
        self._shown_rows: int | None = None  # the rows the last line showed
        self._lock = threading.Lock()  # advance() may come from the task's threads

    def advance(self, rows: int, tokens: int) -> None:
        """``rows`` (of ``tokens`` real tokens) computed, their window not yet committed."""
        with self._lock:
            self._open_rows += rows
            self._open_tokens += tokens
            self.rows += rows
            self.tokens += tokens
            self._maybe_show()

    def restore(self, rows: int) -> None:
        """``rows`` of the open window restored from its checkpoint: done, but not by this run
        (so not in its rate)."""
        with self._lock:
            self._open_rows += rows
            self.rows += rows
            self.start_rows += rows

    def update(self, rows: int, tokens: int, errors: int) -> None:
        """A window of ``rows`` committed (``tokens``, ``errors``: its totals)."""
        with self._lock:
            self.rows += rows - self._open_rows
            self.tokens += tokens - self._open_tokens
            self._open_rows = self._open_tokens = 0
            self.errors += errors
            self._maybe_show()

    def _maybe_show(self) -> None:
        now = time.monotonic()
        gap = _REDRAW_S if self.tty else self.every_s
        if self.enabled and (self.last is None or now - self.last >= gap):
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
        self._shown_rows = self.rows
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
        """The last state: the bar's final form on a terminal; otherwise a last line, unless
        the last one shown already said it."""
        with self._lock:
            if not self.enabled:
                return
            if self.tty:
                self._show(time.monotonic(), final=True)
            elif self._shown_rows != self.rows:
                self._show(time.monotonic())


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
