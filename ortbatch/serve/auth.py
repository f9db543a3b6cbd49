"""The server's door: an API key every request but the health checks must carry.

HTTP clients send ``Authorization: Bearer KEY`` (OpenAI's clients do it from their
``api_key``); gRPC clients send the same as the ``authorization`` metadata entry. A
missing or wrong key is answered 401 (gRPC: UNAUTHENTICATED) before the request body
is read, so it never reaches the model (HTTP's door: :mod:`ortbatch.serve.http.auth`;
gRPC's: :mod:`ortbatch.serve.grpc.service`). Keys are compared with
:func:`hmac.compare_digest`, whose time does not depend on where the strings differ.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from ..errors import OrtBatchError

__all__ = ["API_KEY_ENV", "OPEN_PATHS", "ApiKey", "resolve_api_key"]

#: Environment variable read when neither ``--api-key`` nor ``--api-key-file`` is given.
API_KEY_ENV = "ORTBATCH_API_KEY"
#: HTTP routes that answer without a key: liveness and readiness probes (an orchestrator
#: must be able to ask without the secret).
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})


class ApiKey:
    """A bearer key and the check of an ``Authorization`` value against it."""

    def __init__(self, key: str) -> None:
        if not key or key != key.strip() or any(c.isspace() for c in key):
            raise OrtBatchError("the API key must be a non-empty string without whitespace")
        # HTTP clients (httpx, so the openai package) send header values as ASCII and gRPC
        # metadata must be printable ASCII: a key of other characters could never be sent
        if not all("!" <= c <= "~" for c in key):
            raise OrtBatchError(
                "the API key must be printable ASCII (letters, digits, punctuation): clients cannot send other "
                "characters in the Authorization header or gRPC metadata"
            )
        self._expected = f"Bearer {key}".encode()

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether ``authorization`` (the header's value) is ``Bearer <the key>``.

        Always one :func:`hmac.compare_digest` over the whole value, so the answer's
        timing says nothing about how much of a guess was right.
        """
        if authorization is None:
            authorization = b""
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "surrogateescape")
        # the scheme is case-insensitive (RFC 7235); the key is not
        if authorization[:7].lower() == b"bearer ":
            authorization = b"Bearer " + authorization[7:].strip()
        return hmac.compare_digest(authorization, self._expected)


def resolve_api_key(key: str | None = None, key_file: str | Path | None = None) -> str | None:
    """The API key from ``key``, else the first line of ``key_file``, else the
    ``ORTBATCH_API_KEY`` environment variable; ``None`` when none is set."""
    if key is not None and key_file is not None:
        raise OrtBatchError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise OrtBatchError(f"cannot read the API key file {str(key_file)!r}: {exc.strerror}") from None
        key = text.strip()
        if not key:
            raise OrtBatchError(f"the API key file {str(key_file)!r} is empty")
    elif key is None:
        key = os.environ.get(API_KEY_ENV) or None
    if key is not None:
        ApiKey(key)  # validate here, where the user can still be told which flag was wrong
    return key
