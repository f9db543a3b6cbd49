"""Where a server listens: the listening socket (:func:`bind_socket`), the port the front
ends' gRPC servers share (:func:`reserve_port`), the URL printed at startup, and the
warning for an address other machines can reach.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys

from ..errors import ServeError
from .auth import API_KEY_ENV
from .config import ServeConfig

__all__ = ["bind_socket", "is_loopback", "reserve_port", "url_of", "warn_if_exposed"]

log = logging.getLogger("ortbatch.serve")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket; ``port=0`` picks a free port (read it back with
    ``sock.getsockname()[1]``), with no window for another process to take it."""
    return _bound(host, port, backlog=backlog)


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, never listening, SO_REUSEPORT socket holding ``host:port`` (0: a free
    one) for the front ends' gRPC servers, which bind it with SO_REUSEPORT too."""
    return _bound(host, port, backlog=None, what="gRPC cannot listen")


def _bound(host: str, port: int, *, backlog: int | None, what: str = "cannot listen") -> socket.socket:
    """A TCP socket bound to ``host:port``: listening (``backlog``, inheritable by a
    child process), or with ``backlog=None`` only holding the port for SO_REUSEPORT
    sharers. A :class:`ServeError` naming the address when it does not resolve or
    cannot be bound."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ServeError(f"port must be 0-65535 (0 picks a free one), got {port!r}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:  # socket.gaierror: a name that does not resolve
        raise ServeError(f"cannot listen on {host!r}: the address does not resolve ({exc.strerror or exc})") from None
    family, _, proto, _, addr = infos[0]
    # proto must say IPPROTO_TCP: asyncio turns on TCP_NODELAY only for sockets that do, and
    # without it every response written in two parts (headers, body) waits ~40 ms for the
    # client's delayed ACK (Nagle), capping one client at ~25 requests/s.
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    try:
        if backlog is None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        if backlog is not None:
            sock.listen(backlog)
            sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        raise ServeError(f"{what} on {host}:{port}: {exc.strerror or exc}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket, tls: bool = False) -> str:
    """The URL a listening socket answers on (``[host]`` for IPv6)."""
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def warn_if_exposed(config: ServeConfig) -> None:
    """Warn (stderr) about a bind reachable from other machines without an API key."""
    if is_loopback(config.host):
        return
    if config.api_key is None:
        print(
            f"ortbatch serve: warning: binding {config.host}, reachable from other machines, without an API "
            "key: anyone who can reach it can use the model (set --api-key, --api-key-file or "
            f"{API_KEY_ENV})",
            file=sys.stderr,
            flush=True,
        )
    else:
        log.warning("ortbatch serve: binding %s, reachable from other machines", config.host)
