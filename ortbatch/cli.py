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

from . import __version__
from .errors import OrtBatchError

__all__ = ["main"]


def _commands() -> list[str]:
    from . import commands

    return sorted(m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ortbatch",
        description="Export Hugging Face models to ONNX, validate them, and serve them batched.",
    )
    parser.add_argument("--version", action="version", version=f"ortbatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _commands():
        module = importlib.import_module(f"ortbatch.commands.{name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
