"""Several grpcio servers on one port in one process (``GrpcServer(accept_loops=N)``):
they all listen, connections spread over them, every answer is its own request's, a
port someone else holds is still refused, and stopping stops them all."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")

from ortbatch.errors import OrtBatchError  # noqa: E402
from ortbatch.serve import ServedModel  # noqa: E402
from ortbatch.serve.grpc import GrpcServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _listeners(port: int) -> int:
    """Listening TCP sockets on ``port`` (Linux /proc)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def _inputs(x: np.ndarray, k: np.ndarray):
    a = grpcclient.InferInput("x", list(x.shape), "FP32")
    a.set_data_from_numpy(x)
    b = grpcclient.InferInput("k", list(k.shape), "INT32")
    b.set_data_from_numpy(k)
    return [a, b]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_four_servers_listen_and_sixteen_connections_each_get_their_own_answers(adder_path):
    plain = ort.InferenceSession(str(adder_path), providers=["CPUExecutionProvider"])
    model = ServedModel.load(adder_path, session_kwargs={"max_batch_size": 8})
    errors: list[BaseException] = []
    with GrpcServer(model, port=0, accept_loops=4) as srv:
        assert _listeners(srv.port) == 4

        def client(c: int) -> None:
            # one channel per client: its own connection, so the kernel spreads them
            conn = grpcclient.InferenceServerClient(srv.address, channel_args=[("grpc.use_local_subchannel_pool", 1)])
            try:
                for i in range(25):
                    x = np.full((1, 3), c * 100 + i, np.float32)
                    k = np.array([[c]], np.int32)
                    got = conn.infer("adder", _inputs(x, k)).as_numpy("y")
                    want = plain.run(["y"], {"x": x, "k": k})[0]
                    assert got.dtype == want.dtype and np.array_equal(got, want), (c, i)
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:
                conn.close()

        threads = [threading.Thread(target=client, args=(c,)) for c in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert srv.counts.accepted == srv.counts.answered == 400
    assert _listeners(srv.port) == 0  # stopped: every one of them
    model.close()


def test_a_port_another_process_listens_on_is_refused(adder_path):
    model = ServedModel.load(adder_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OrtBatchError, match="in use"):
            GrpcServer(model, port=port, accept_loops=4).start()
        with pytest.raises(OrtBatchError, match="cannot listen"):
            GrpcServer(model, port=port, accept_loops=1).start()
    model.close()


def test_accept_loops_must_be_positive(adder_path):
    model = ServedModel.load(adder_path)
    with pytest.raises(OrtBatchError, match="accept_loops"):
        GrpcServer(model, port=0, accept_loops=0)
    model.close()
