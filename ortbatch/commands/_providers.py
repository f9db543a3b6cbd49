"""``--providers`` for every command: one spelling table (``ortbatch._ort.SHORTCUTS``)."""

from __future__ import annotations

import argparse

from .._ort import parse_provider_names
from ..errors import ProviderError

__all__ = ["PROVIDERS_HELP", "providers_arg"]

PROVIDERS_HELP = "comma-separated: cpu, cuda (gpu), tensorrt (trt) or ONNX Runtime names, e.g. cpu,cuda,trt"


def providers_arg(text: str) -> str:
    """argparse ``type=``: refuse an unknown provider at once (exit 2, one line naming the
    valid spellings); keep the user's text, which the resolver reads the same way."""
    try:
        parse_provider_names(text)
    except ProviderError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
