"""HTTP's door: the API key (:class:`~ortbatch.serve.auth.ApiKey`) checked before a
request reaches an app."""

from __future__ import annotations

from typing import Any

from ..auth import OPEN_PATHS, ApiKey
from .plumbing import openai_error, send_json

__all__ = ["ApiKeyMiddleware"]


class ApiKeyMiddleware:
    """ASGI middleware answering 401 to HTTP requests without the right bearer key
    (all routes but :data:`OPEN_PATHS` and the API docs page, whose static Swagger UI asks
    for the key itself: :mod:`.openapi`). The error body has the shape of the route's
    other errors: OpenAI's under ``/v1/``, ``{"error": ...}`` elsewhere. A request let in
    carries ``scope["ortbatch.auth"] = True`` (the OpenAPI document then declares the
    bearer scheme). Attributes of the wrapped app (``state``) are reachable through it."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self._key = ApiKey(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path == "/docs" or path.startswith("/docs/"):
            await self.app(scope, receive, send)
            return
        value = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if self._key.allows(value):
            scope["ortbatch.auth"] = True
            await self.app(scope, receive, send)
            return
        message = "missing API key" if value is None else "invalid API key"
        message += ": send the header 'Authorization: Bearer <key>'"
        if path.startswith("/v1/"):
            doc: Any = openai_error(401, message)
        else:
            doc = {"error": message}
        await send_json(send, 401, doc, [(b"www-authenticate", b"Bearer")])
