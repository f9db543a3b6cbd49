"""HTTP connections are dealt to the front ends in turn (serve/frontends/dealer.py): the
dealer on its own with stand-in front ends, then ``ortbatch serve --frontends 2`` as
users run it: sixteen keep-alive connections split eight and eight (a shared accept
socket split them 5/11 or 2/14), over HTTP and HTTPS."""

from __future__ import annotations

import collections
import select
import socket
import ssl
import time

import httpx
import pytest
from test_auth_tls import _self_signed
from test_frontends import pid_of_metrics

from ortbatch.serve.frontends.dealer import ConnectionDealer, channel_pair


def _listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def _received(theirs: socket.socket, n: int) -> list[bytes]:
    """What the clients wrote on each of the ``n`` connections a stand-in front end got."""
    out = []
    theirs.settimeout(5)
    for _ in range(n):
        _, fds, _, _ = socket.recv_fds(theirs, 16, 1)
        assert len(fds) == 1
        with socket.socket(fileno=fds[0]) as conn:
            conn.settimeout(5)
            out.append(conn.recv(16))
    return out


def _clients(port: int, n: int, first: int = 0) -> list[socket.socket]:
    """``n`` connections, each having sent its number (``first``, ``first + 1``, ...)."""
    clients = []
    for i in range(first, first + n):
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        c.sendall(b"%d" % i)
        clients.append(c)
    return clients


@pytest.fixture
def channels():
    """Two front ends' channels (the engine's end, the front end's), closed after."""
    pairs = [channel_pair(), channel_pair()]
    yield pairs
    for pair in pairs:
        for end in pair:
            end.close()


def test_connections_are_dealt_in_turn(channels):
    listener = _listener()
    (a, a_fe), (b, b_fe) = channels
    dealer = ConnectionDealer(listener, lambda: [a, b]).start()
    try:
        clients = []
        for i in range(10):  # one at a time: each is dealt before the next connects
            clients += _clients(listener.getsockname()[1], 1, first=i)
            deadline = time.monotonic() + 5
            while dealer.dealt < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        got_a, got_b = _received(a_fe, 5), _received(b_fe, 5)
        assert dealer.dealt == 10 and dealer.refused == 0
        turns = {tuple(sorted(int(x) for x in got)) for got in (got_a, got_b)}
        assert turns == {(0, 2, 4, 6, 8), (1, 3, 5, 7, 9)}  # one each, in turn
    finally:
        dealer.stop()
        listener.close()
        for c in clients:
            c.close()


def test_a_front_end_that_is_gone_is_skipped(channels):
    listener = _listener()
    (a, a_fe), (b, b_fe) = channels
    b_fe.close()  # that front end died: sending to its channel fails
    dealer = ConnectionDealer(listener, lambda: [a, b]).start()
    try:
        clients = _clients(listener.getsockname()[1], 4)
        assert sorted(_received(a_fe, 4)) == [b"0", b"1", b"2", b"3"]
        assert dealer.dealt == 4 and dealer.refused == 0
    finally:
        dealer.stop()
        listener.close()
        for c in clients:
            c.close()


def test_a_connection_left_in_a_dead_front_ends_channel_is_dealt_again(channels):
    """A front end killed with a connection dealt but not yet taken: the connection goes to
    the next front end, unread (issue 26: a client that reconnected at once lost it too)."""
    listener = _listener()
    (a, a_fe), (b, b_fe) = channels
    dealer = ConnectionDealer(listener, lambda: [a, b]).start()
    try:
        clients = _clients(listener.getsockname()[1], 1)
        deadline = time.monotonic() + 5
        while dealer.dealt < 1:
            assert time.monotonic() < deadline, "never dealt"
            time.sleep(0.005)
        first, other = (a_fe, b_fe) if select.select([a_fe], [], [], 5)[0] else (b_fe, a_fe)
        first.close()  # dies with the descriptor still in its channel, never acknowledged
        assert _received(other, 1) == [b"0"]
        assert dealer.dealt == 1 and dealer.refused == 0
    finally:
        dealer.stop()
        listener.close()
        for c in clients:
            c.close()


def test_an_acknowledged_connection_is_the_front_ends_alone(channels):
    listener = _listener()
    (a, a_fe), _ = channels
    dealer = ConnectionDealer(listener, lambda: [a]).start()
    try:
        (client,) = _clients(listener.getsockname()[1], 1)
        a_fe.settimeout(5)
        _, fds, _, _ = socket.recv_fds(a_fe, 16, 1)
        a_fe.send(b"a")  # taken, as adopting_server acknowledges it
        socket.socket(fileno=fds[0]).close()  # the front end closes it: the client sees it closed
        client.settimeout(5)
        try:
            assert client.recv(16) == b""
        except ConnectionResetError:
            pass
        client.close()
    finally:
        dealer.stop()
        listener.close()


def test_with_no_front_end_serving_a_connection_is_closed():
    listener = _listener()
    dealer = ConnectionDealer(listener, list, wait_s=0.2).start()
    try:
        (client,) = _clients(listener.getsockname()[1], 1)
        client.settimeout(5)
        try:
            data = client.recv(16)
        except ConnectionResetError:
            data = b""
        assert data == b"" and dealer.refused == 1
        client.close()
    finally:
        dealer.stop()
        listener.close()


def test_a_connection_waits_for_a_front_end_that_is_restarting(channels):
    listener = _listener()
    (a, a_fe), _ = channels
    serving: list[socket.socket] = []
    dealer = ConnectionDealer(listener, lambda: list(serving), wait_s=10.0).start()
    try:
        (client,) = _clients(listener.getsockname()[1], 1)
        time.sleep(0.3)  # none serves yet: the connection waits, it is not closed
        assert dealer.dealt == 0 and dealer.refused == 0
        serving.append(a)  # the front end is back
        assert _received(a_fe, 1) == [b"0"]
        assert dealer.dealt == 1
        client.close()
    finally:
        dealer.stop()
        listener.close()


def test_stop_ends_the_accepting():
    listener = _listener()
    dealer = ConnectionDealer(listener, list).start()
    dealer.stop()
    assert not dealer._thread.is_alive()
    listener.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sixteen_connections_split_eight_and_eight(serve_process, encoder_dir):
    srv = serve_process(str(encoder_dir), "--name", "tiny", "--frontends", "2", "--no-access-log")
    clients = [httpx.Client(base_url=srv.url, timeout=10) for _ in range(16)]
    try:
        pids = [pid_of_metrics(c.get("/metrics").text) for c in clients]  # one connection each, opened in turn
        again = [pid_of_metrics(c.get("/metrics").text) for c in clients]  # kept alive: the same front end
    finally:
        for c in clients:
            c.close()
    assert sorted(collections.Counter(pids).values()) == [8, 8]
    assert again == pids


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_https_through_two_front_ends(serve_process, encoder_dir, tmp_path):
    certfile, keyfile = _self_signed(tmp_path)
    srv = serve_process(
        str(encoder_dir),
        *("--name", "tiny", "--frontends", "2", "--no-access-log"),
        *("--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile)),
    )
    assert srv.url.startswith("https://")
    trust = ssl.create_default_context(cafile=str(certfile))
    body = {
        "inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [5, 6, 7]},
            {"name": "attention_mask", "datatype": "INT64", "shape": [1, 3], "data": [1, 1, 1]},
        ],
        "outputs": [{"name": "pooled"}],
    }
    pids, answers = [], []
    for _ in range(4):
        with httpx.Client(base_url=srv.url, verify=trust, timeout=10) as http:
            pids.append(pid_of_metrics(http.get("/metrics").text))
            r = http.post("/v2/models/tiny/infer", json=body)
            assert r.status_code == 200, r.text
            answers.append(r.json()["outputs"][0]["data"])
    assert len(set(pids)) == 2  # both front ends served TLS connections
    assert all(a == answers[0] for a in answers)
    with pytest.raises(httpx.ConnectError):  # the certificate is not in the default trust store
        httpx.get(srv.url + "/v2/health/live", timeout=10)
