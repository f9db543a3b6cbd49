"""The ``ortbatch`` command line: ``ortbatch export|validate|bench|serve|demo|...``.

Each subcommand lives in its own module under :mod:`ortbatch.commands` exposing
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``. Those modules
must import nothing heavy at import time, so ``ortbatch --help`` stays instant and
works without the optional extras.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from typing import NoReturn

from . import __version__
from .errors import OrtBatchError

__all__ = ["main"]


def _commands() -> list[str]:
    from . import commands

    return sorted(m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_"))


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a mistake is said first: argparse prints the usage (30 lines
    for ``serve``) and then the error, so the "did you mean" scrolled off above the fold."""

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage()
        if usage.count("\n") > 4:  # a long usage: one line pointing at --help instead
            usage = f"usage: {self.prog} [options] ...  (`{self.prog} --help` lists them)\n"
        self.exit(2, f"{self.prog}: error: {message}\n{usage}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ortbatch",
        description="Export Hugging Face models to ONNX, validate them, and serve them batched.",
    )
    parser.add_argument("--version", action="version", version=f"ortbatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _commands():
        module = importlib.import_module(f"ortbatch.commands.{name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def _unrecognized(parser: argparse.ArgumentParser, extra: Sequence[str]) -> str:
    """argparse's "unrecognized arguments" message, with a "did you mean" for each unknown
    flag close to one of ``parser``'s."""
    import difflib

    known = [o for action in parser._actions for o in action.option_strings]
    hints = []
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag.startswith("-"):
            close = difflib.get_close_matches(flag, known, n=1)
            if close:
                hints.append(f"{flag}: did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(extra)}" + "".join(f"\n  {h}" for h in hints)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's usage, not the top level's (exits 2)
        getattr(args, "_parser", parser).error(_unrecognized(getattr(args, "_parser", parser), extra))
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except OrtBatchError as exc:
        print(f"ortbatch {args.command}: error: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 1))  # 2 for a bad argument (commands/_target.py)
    except ImportError as exc:
        print(f"ortbatch {args.command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # what the machine refused: a path under a file, a permission, a full disk
        print(f"ortbatch {args.command}: error: {_os_error(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _os_error(exc: OSError) -> str:
    """``exc`` in one line: what the system said, and the path(s) it said it of."""
    if exc.strerror and exc.filename is not None:
        paths = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
        return f"{exc.strerror}: {paths}"
    return str(exc) or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
