"""Child processes that are sent Ctrl-C must be able to take it.

A process started from a shell's background job (``cmd &`` without job control, as a CI runner
may start the suite) inherits SIGINT *ignored*, and Python then installs no KeyboardInterrupt
handler: a test's SIGINT would do nothing and the test would fail for its runner's reason.
Pass :func:`sigint_default` as ``preexec_fn`` to restore the default disposition in the child
before it starts, as a terminal's Ctrl-C would find it."""

from __future__ import annotations

import signal


def sigint_default() -> None:
    """In the child, before exec: SIGINT back to its default (Python turns it into KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
