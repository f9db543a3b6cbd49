"""Sockets from bind_socket get TCP_NODELAY on every accepted connection (asyncio sets
it only when the socket's proto is IPPROTO_TCP); without it each HTTP response waited
~40 ms for the client's delayed ACK."""

from __future__ import annotations

import asyncio
import socket

from ortbatch.serve import bind_socket


def test_accepted_connections_have_nodelay():
    async def main() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = bind_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0
