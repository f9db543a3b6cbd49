"""Issue 47, what an attacker found: keyless trickles, loop-blocking tokenize, stalled
streams, grammars that break their schema or leak internals, bad Batch API lines, and
``ortbatch run`` on other people's files. Each test fails on 805c2e7 and passes after."""

from __future__ import annotations

import json
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


# -- item 2: /tokenize and /detokenize are bounded and off the event loop -----------------------
class GatedTokenizer:
    """Wraps a tokenizers.Tokenizer: its encode and decode calls wait for the test's gate."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _held(self, name):
        def call(*args, **kw):
            self.entered.set()
            assert self.gate.wait(60)
            return getattr(self.inner, name)(*args, **kw)

        return call

    def __getattr__(self, name):
        if name in ("encode", "encode_batch", "decode", "decode_batch"):
            return self._held(name)
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def gated_server(encoder_dir):
    model = ServedModel.load(encoder_dir, name="minilm", session_kwargs={"max_batch_size": 8})
    tok = GatedTokenizer(model.tokenizer)
    model.tokenizer = tok
    with BackgroundServer(model, quiet()) as srv:
        yield srv, tok


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/detokenize", {"ids": [[1, 2]] * 1000}),  # the tiny vocabulary has 31 ids
        ("/tokenize", {"inputs": ["hello world " * 80] * 1000}),
        ("/tokenize", {"prompt": "hello world " * 8000}),
        ("/detokenize", {"tokens": [1, 2] * 1000}),
    ],
    ids=["detokenize-lists", "tokenize-texts", "tokenize-prompt", "detokenize-tokens"],
)
def test_tokenize_and_detokenize_answer_health_while_in_flight(gated_server, path, body):
    srv, tok = gated_server
    tok.gate.clear()
    tok.entered.clear()
    answer: dict[str, httpx.Response] = {}

    def big() -> None:
        answer["r"] = httpx.post(srv.url + path, json=body, timeout=120)

    t = threading.Thread(target=big)
    t.start()
    try:
        assert tok.entered.wait(60)  # the tokenizer is running (and held) now
        ready = httpx.get(srv.url + "/v2/health/ready", timeout=30)  # would wait if it held the loop
    finally:
        tok.gate.set()
        t.join(120)
    assert ready.status_code == 200
    assert answer["r"].status_code == 200, answer["r"].text


@pytest.fixture(scope="module")
def tokenize_server(encoder_dir):
    model = ServedModel.load(encoder_dir, name="minilm", session_kwargs={"max_batch_size": 8})
    with BackgroundServer(model, quiet()) as srv:
        yield srv


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/detokenize", {"ids": [[101, 102]] * 10_000}, 413, "at most 1024"),
        ("/detokenize", {"ids": [[101] * 600_000, [102] * 600_000]}, 413, "at most 1048576"),
        ("/detokenize", {"tokens": [101] * 1_100_000}, 413, "at most 1048576"),
        ("/tokenize", {"inputs": ["x"] * 2000}, 413, "at most 1024"),
        ("/tokenize", {"inputs": ["hello " * 16_000] * 12}, 413, "at most 1048576"),
        ("/tokenize", {"inputs": "x" * 20_000_000}, 413, "at most 100000 per text"),
        ("/tokenize", {"prompt": "x" * 20_000_000}, 413, "at most 100000 per text"),
        ("/tokenize", {"inputs": ["ok", "\ud800"]}, 400, "lone surrogate"),
        ("/tokenize", {"prompt": "a\udfffb"}, 400, "lone surrogate"),
        ("/detokenize", {"ids": [[101, 10**30]]}, 400, "outside the vocabulary"),
    ],
    ids=[
        "10k-lists",
        "ids-in-all",
        "tokens-in-all",
        "2k-texts",
        "chars-in-all",
        "20mb-text",
        "20mb-prompt",
        "surrogate",
        "surrogate-prompt",
        "huge-id",
    ],
)
def test_tokenize_and_detokenize_refuse_unbounded_input_naming_the_limit(tokenize_server, path, body, status, says):
    content = json.dumps(body)  # ASCII: lone surrogates as \\ud800 escapes, as a client may send them
    r = httpx.post(
        tokenize_server.url + path, content=content, headers={"content-type": "application/json"}, timeout=120
    )
    assert r.status_code == status, r.text[:300]
    assert says in r.text


# -- item 3: a stream whose reader stops reading is bounded, then cut ---------------------------
class EndlessGenerator:
    """FakeGenerator's tokens, emitted as fast as the thread runs until the request is cancelled
    (``cancelled`` set) or ``max_tokens`` are out."""

    def __new__(cls):
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent))
        from fakegen import FakeGenerator

        class Endless(FakeGenerator):
            def __init__(self) -> None:
                super().__init__(context=10**7)
                self.cancelled_event = threading.Event()
                self.emitted = 0

            def _run(self, fut, n_prompt, n, on_token):
                from types import SimpleNamespace

                for i in range(n):
                    if fut.cancelled():
                        self.cancelled_event.set()
                        return
                    self.emitted += 1
                    on_token(SimpleNamespace(text="ab"[i % 2], token_id=i, index=i, logprob=None, prompt_logprobs=None))
                fut.set_running_or_notify_cancel()
                fut.set_result(None)  # never reached in the test: the stream is cut first

        return Endless()


def _stalled_stream(port: int, path: str, body: dict) -> socket.socket:
    """A client that sends a streamed request and never reads (a small receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 300_000, "stream": True, "n": 2}),
        ("/v2/models/fake/generate_stream", {"text_input": "ab", "parameters": {"max_tokens": 300_000}}),
    ],
    ids=["openai", "v2-generate-stream"],
)
def test_a_stream_nobody_reads_is_bounded_cancelled_and_does_not_hold_shutdown(monkeypatch, path, body):
    import time

    from ortbatch.serve import ServedGenerator
    from ortbatch.serve.http import plumbing
    from ortbatch.serve.served import streaming

    monkeypatch.setattr(plumbing, "STREAM_WRITE_TIMEOUT_S", 0.5, raising=False)
    gen = EndlessGenerator()
    srv = BackgroundServer(ServedGenerator(gen, "fake"), quiet(graceful_timeout_s=120)).start()
    client = None
    try:
        client = _stalled_stream(_port(srv), path, body)
        # the reader never reads: the stream's buffer fills, then its requests are cancelled
        assert gen.cancelled_event.wait(60)
        assert streaming.pending_pieces() <= streaming.MAX_PENDING * 2  # bounded, and released below
        # a health probe is answered meanwhile
        assert httpx.get(srv.url + "/v2/health/ready", timeout=30).status_code == 200
    finally:
        started = time.monotonic()
        srv.stop()
        stop_s = time.monotonic() - started
        if client is not None:
            client.close()
    assert streaming.pending_pieces() == 0
    assert stop_s < 60, stop_s  # the grace is 120 s: the stalled stream did not hold it


# -- item 8: the exit report counts a killed front end's requests --------------------------------
def _front_end_pids(pid: int) -> list[int]:
    from pathlib import Path

    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/task"), reason="finds the front ends in /proc")
def test_the_exit_report_counts_a_killed_front_ends_requests(serve_process, encoder_dir):
    import os
    import re
    import signal
    import time

    srv = serve_process(str(encoder_dir), "--frontends", "2", "--no-access-log")
    sent = 40
    for i in range(sent):  # a connection each: the engine deals them to the front ends in turn
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": f"text {i}"}, headers={"Connection": "close"})
        assert r.status_code == 200, r.text
    pids = _front_end_pids(srv.proc.pid)
    assert len(pids) == 2, pids
    # the front ends tell the engine their counts every 0.5 s; nothing else can say when it has
    time.sleep(2.0)
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 60  # a hang guard: the engine restarts the killed one
    while "restarted" not in srv.text():
        assert time.monotonic() < deadline, srv.text()
        time.sleep(0.05)
    srv.terminate()
    assert srv.wait(60) == 0, srv.text()
    m = re.search(r"stopped; requests accepted=(\d+) answered=(\d+)", srv.text())
    assert m, srv.text()
    assert int(m.group(1)) >= sent and int(m.group(2)) >= sent, srv.text()
