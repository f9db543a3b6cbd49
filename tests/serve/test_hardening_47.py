"""Issue 47, what an attacker found: keyless trickles, loop-blocking tokenize, stalled
streams, grammars that break their schema or leak internals, bad Batch API lines, and
``ortbatch run`` on other people's files. Each test fails on 805c2e7 and passes after."""

from __future__ import annotations

import resource
import socket
import threading

import httpx
import pytest

from ortbatch.serve import BackgroundServer, ServeConfig, ServedModel

pytestmark = pytest.mark.timeout(180)


def quiet(**kw: object) -> ServeConfig:
    return ServeConfig(port=0, access_log=False, log_level="warning", **kw)  # type: ignore[arg-type]


def _fds(count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * count + 512  # the client's ends and the server's, in this one process
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"needs {want} file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))


def _port(srv: BackgroundServer) -> int:
    return int(srv.url.rsplit(":", 1)[1])


# -- item 1: a keyless trickle does not take health down ----------------------------------------
@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_1500_trickling_connections_leave_health_and_keyed_requests_answered(encoder_dir, parser):
    trickles = 1500
    _fds(trickles)
    key = "k" * 32
    # the deadlines outlast the test: only not counting them toward the limit can answer the probes
    config = quiet(
        api_key=key,
        limit_concurrency=1000,
        header_timeout_s=300,
        body_timeout_s=300,
        first_byte_timeout_s=300,
        max_idle_per_address=None,
        http_parser=parser,
    )
    model = ServedModel.load(encoder_dir, name="minilm", session_kwargs={"max_batch_size": 8})
    held: list[socket.socket] = []
    try:
        with BackgroundServer(model, config) as srv:
            for i in range(trickles):
                s = socket.create_connection(("127.0.0.1", _port(srv)), timeout=30)
                held.append(s)
                if i % 2:  # the request line and one header line so far
                    s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
                else:  # whole headers, a body that stops after a byte
                    s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            # accepted and read in order: the trickles' bytes were read before these requests'
            with httpx.Client(timeout=60) as client:  # a hang guard only
                ready = client.get(srv.url + "/v2/health/ready")
                r = client.post(
                    srv.url + "/v1/embeddings",
                    json={"model": "minilm", "input": "hello"},
                    headers={"Authorization": f"Bearer {key}"},
                )
            assert ready.status_code == 200, ready.text
            assert r.status_code == 200, r.text
            # and a header trickle is still open: nothing was evicted to make room
            held[1].setblocking(False)
            with pytest.raises(BlockingIOError):
                held[1].recv(1)
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_body_no_route_reads_is_cut_off_at_the_deadline_from_the_first_byte(adder_path, parser):
    # /v2/health/live answers without reading the body: only the connection's deadline ends it
    config = quiet(header_timeout_s=0.2, body_timeout_s=0.3, keep_alive_s=60, http_parser=parser)
    with BackgroundServer(ServedModel.load(adder_path), config) as srv:
        s = socket.create_connection(("127.0.0.1", _port(srv)), timeout=30)  # a hang guard only
        try:
            s.sendall(b"POST /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nab")
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        finally:
            s.close()
    assert answer == b"" or answer.startswith(b"HTTP/1.1 ")  # answered or not, then closed


def test_idle_connections_of_one_address_do_not_evict_a_probe_that_has_sent():
    import uvicorn

    from ortbatch.serve.http.connection import header_timeout_protocol

    gate = threading.Event()
    blocked = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/block":  # holds the event loop itself until the test opens the gate
            blocked.set()
            gate.wait(60)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    port = listener.getsockname()[1]
    protocol = header_timeout_protocol(300, "auto", 300, 8)
    # asyncio's loop runs every accepted connection's connection_made before reading any of them,
    # so the probe is idle (unread) when the 50 arrive, as under load with any loop
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, http=protocol, loop="asyncio")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    idle: list[socket.socket] = []
    blocker = None
    try:
        for _ in range(600):
            if server.started:
                break
            threading.Event().wait(0.05)  # a startup poll (uvicorn has no started event)
        blocker = socket.create_connection(("127.0.0.1", port), timeout=30)
        blocker.sendall(b"GET /block HTTP/1.1\r\nHost: x\r\n\r\n")
        assert blocked.wait(30)
        # while the loop is held: the probe connects and sends, then 50 idle connections arrive
        probe = socket.create_connection(("127.0.0.1", port), timeout=30)
        probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        idle += [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(50)]
        gate.set()
        answer = probe.recv(4096)
        probe.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer
        # the cap still holds for the truly idle: the oldest of them were closed
        assert idle[0].recv(1) == b""
    finally:
        gate.set()
        server.should_exit = True
        thread.join(30)
        for s in [*idle, listener] + ([blocker] if blocker else []):
            s.close()
