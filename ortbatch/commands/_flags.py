"""Flags more than one command declares, declared once: ``--providers`` (one spelling table,
``ortbatch._ort.SHORTCUTS``) and the runtime flags ``serve`` and ``bench`` both pass to
BatchedSession, so the same flag means and validates the same in both."""

from __future__ import annotations

import argparse
import math
from typing import Any

from .._ort import parse_provider_names
from ..errors import ProviderError

__all__ = [
    "PROVIDERS_HELP",
    "add_runtime_arguments",
    "non_negative_float",
    "port",
    "positive_float",
    "positive_int",
    "providers_arg",
]

PROVIDERS_HELP = "comma-separated: cpu, cuda (gpu), tensorrt (trt) or ONNX Runtime names, e.g. cpu,cuda,trt"


def providers_arg(text: str) -> str:
    """argparse ``type=``: refuse an unknown provider at once (exit 2, one line naming the
    valid spellings); keep the user's text, which the resolver reads the same way."""
    try:
        parse_provider_names(text)
    except ProviderError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _finite(text: str, *, zero: bool) -> float:
    """``text`` as a finite number above 0 (or at least 0 with ``zero``), else an argparse error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    if value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be {'0 or more' if zero else 'above 0'}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number above 0 (seconds, a rate, a share of CPUs)."""
    return _finite(text, zero=False)


def non_negative_float(text: str) -> float:
    """argparse ``type=``: a finite number of at least 0 (a delay that may be none, a share of GPUs)."""
    return _finite(text, zero=True)


def port(text: str) -> int:
    """argparse ``type=``: a TCP port, 0 for a free one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number (0-65535), got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0-65535; 0 picks a free one), got {value}")
    return value


def add_runtime_arguments(
    parser: argparse.ArgumentParser | Any,
    *,
    max_batch_size: int | None,
    max_batch_size_help: str,
    max_batch_tokens_help: str,
    latency_help: str,
) -> None:
    """The BatchedSession flags of ``serve`` and ``bench``: ``--max-batch-size``,
    ``--max-batch-tokens``, ``--max-delay-ms``, ``--workers``, ``--no-latency-session`` and
    ``--providers``. Only the defaults and help that differ between the commands are given."""
    parser.add_argument("--max-batch-size", type=positive_int, default=max_batch_size, help=max_batch_size_help)
    parser.add_argument("--max-batch-tokens", type=positive_int, default=None, help=max_batch_tokens_help)
    parser.add_argument(
        "--max-delay-ms",
        type=non_negative_float,
        default=0.0,
        help="how long a free worker may wait for a fuller batch (default 0)",
    )
    parser.add_argument("--workers", type=positive_int, default=None, help="batches in flight (default 2)")
    parser.add_argument("--no-latency-session", action="store_true", help=latency_help)
    parser.add_argument(
        "--providers", default=None, type=providers_arg, help=f"{PROVIDERS_HELP} (default: CUDA if it loads, else CPU)"
    )
