"""HTTP's part of the traces (:mod:`ortbatch.serve.tracing`): one SERVER span per request,
the child of the client's W3C ``traceparent`` when it sends one, named by the route's
template (``POST /v2/models/{name}/infer``) and current while the app handles it, so the
spans of tokenization, the queue and the batch join it. Mounted outermost, by
:func:`~ortbatch.serve.assembly.app_for`, only when tracing is on."""

from __future__ import annotations

from typing import Any

from ..tracing import Tracing, traced_request

__all__ = ["TracingMiddleware"]


class TracingMiddleware:
    """ASGI middleware: a span per HTTP request (status and route as attributes; a 5xx
    marks it failed). Attributes of the wrapped app (``state``) are reachable through it."""

    def __init__(self, app: Any, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import Status, StatusCode

        method = scope.get("method", "")
        headers = [(bytes(k).decode("latin-1"), bytes(v).decode("latin-1")) for k, v in scope.get("headers", ())]
        status = 0

        async def observed_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        attributes = {"http.request.method": method, "url.path": scope.get("path", "")}
        with traced_request(self.tracing, f"{method} {scope.get('path', '')}", headers, **attributes) as sp:
            try:
                await self.app(scope, receive, observed_send)
            finally:
                route = scope.get("ortbatch.endpoint")
                if route:
                    sp.update_name(f"{method} {route}")
                    sp.set_attribute("http.route", route)
                if status:
                    sp.set_attribute("http.response.status_code", status)
                if status >= 500:
                    sp.set_status(Status(StatusCode.ERROR))
