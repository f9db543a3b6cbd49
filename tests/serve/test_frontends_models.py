"""The engine's side of a repository over front ends (:class:`EngineModels`), with links
that only record what they are sent: keys and holds, the order of a reload's and an
unload's messages, and that a load or unload is answered only once every front end has
applied it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ortbatch.errors import ModelNotFoundError
from ortbatch.serve.frontends.models import EngineModels
from ortbatch.serve.frontends.proxy import NodeSpec
from ortbatch.serve.frontends.transport import decode_error
from ortbatch.serve.kinds import EncoderKind
from ortbatch.serve.served.kinds import register, unregister
from ortbatch.serve.served.repository import READY, UNAVAILABLE, ModelRepository

pytestmark = pytest.mark.timeout(60)


class _Session:
    manifest = None
    max_batch_size = 4
    max_queue = 8

    def get_inputs(self) -> list[NodeSpec]:
        return [NodeSpec("x", "tensor(float)", ("batch", 3))]

    def get_outputs(self) -> list[NodeSpec]:
        return [NodeSpec("y", "tensor(float)", ("batch", 3))]


class _Served:
    def __init__(self) -> None:
        self.closed = False
        self.inputs: list[Any] = []
        self.session = _Session()

    def close(self, drain: bool = True) -> None:
        self.closed = True


class _FakeKind(EncoderKind):
    """A :class:`_Served` is served as an encoder (its session crosses to the front ends)."""

    name = "fake"
    served_type = _Served
    fallback = False

    def endpoints(self, served: Any) -> dict[str, str]:
        return {}


class _Link:
    """A front end's link that records what the engine sends it."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []
        self._cond = threading.Condition()

    def send(self, messages: list[Any]) -> None:
        with self._cond:
            self.sent.extend(messages)
            self._cond.notify_all()

    def wait_for(self, kind: str, count: int = 1) -> list[tuple[Any, ...]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.of(kind)) >= count, timeout=10), self.sent
            return self.of(kind)

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [m for m in self.sent if m[0] == kind]


def _eventually(check: Any) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[EngineModels, list[_Served]]]:
    (tmp_path / "m").mkdir()
    made: list[_Served] = []

    def loader(directory: Path, name: str) -> _Served:
        made.append(_Served())
        return made[-1]

    monkeypatch.setattr("ortbatch.serve.http.app.build_app", lambda served, *a, **k: object())
    monkeypatch.setattr("ortbatch.serve.served.repository._warm_up", lambda served: None)
    register(_FakeKind())
    try:
        repo = ModelRepository([("m", tmp_path / "m")], loader=loader)
        assert repo.load_all() == []
        yield EngineModels(repo), made
    finally:
        unregister("fake")


def test_a_reload_is_answered_after_every_front_end_applied_it_and_the_old_model_waits_for_their_release(engine):
    models, made = engine
    one, two = _Link(), _Link()
    (record,) = models.attach(one)
    assert record[:5] == ("m", record[1], READY, "", 1) and record[5].kind == "fake"
    assert record[5].info.inputs[0].name == "x"  # the session info its kind sends
    assert [r[4] for r in models.attach(two)] == [1]  # the same model: the same key
    assert models.sessions == {1: made[0].session}

    models.on_control(one, ("load", 7, "m"))  # a reload, asked by front end one
    for link in (one, two):
        (msg,) = link.wait_for("model")
        assert msg[1:4] == ("m", record[1], READY) and msg[5] == 2  # the new model's key
        link.wait_for("sync")
    (sync,) = one.of("sync")
    time.sleep(0.1)
    assert not one.of("reply")  # not before every front end has applied it
    models.on_control(one, ("synced", sync[1]))
    time.sleep(0.1)
    assert not one.of("reply")
    models.on_control(two, ("synced", sync[1]))
    (reply,) = one.wait_for("reply")
    assert reply == ("reply", 7, None) and not two.of("reply")
    assert models.sessions[2] is made[1].session

    # the old model closes once both front ends let go of it
    models.on_control(one, ("released", 1))
    time.sleep(0.1)
    assert not made[0].closed
    models.detach(two)  # a front end that died lets go of everything it held
    _eventually(lambda: made[0].closed)
    models.on_control(one, ("synced", 0))  # a stale barrier token is ignored
    _eventually(lambda: 1 not in models.sessions)
    assert not made[1].closed


def test_an_unload_tells_every_front_end_first_and_waits_for_their_release(engine):
    models, made = engine
    one = _Link()
    models.attach(one)
    models.on_control(one, ("unload", 8, "m"))
    (gone,) = one.wait_for("model")
    assert gone[1:] == ("m", gone[2], UNAVAILABLE, "unloaded", None, None)
    time.sleep(0.1)
    assert not made[0].closed and not one.of("reply")  # front end one still holds it
    models.on_control(one, ("released", 1))
    _eventually(lambda: made[0].closed)
    # its release says it has applied the unload: answered at once
    assert one.wait_for("reply") == [("reply", 8, None)] and not one.of("sync")
    # a model that is not there: 404, and no front end is told anything
    models.on_control(one, ("unload", 9, "ghost"))
    _eventually(lambda: len(one.of("reply")) == 2)
    error = decode_error(*one.of("reply")[1][2])
    assert isinstance(error, ModelNotFoundError)  # HTTP 404
    assert len(one.of("model")) == 1
    # a later front end starts with the model unloaded, and a load gives it to everyone
    two = _Link()
    assert [r[2:] for r in models.attach(two)] == [(UNAVAILABLE, "unloaded", None, None)]
    models.on_control(two, ("load", 10, "m"))
    for link in (one, two):
        link.wait_for("model", 2 if link is one else 1)
        (sync,) = link.wait_for("sync")
        models.on_control(link, ("synced", sync[1]))
    assert two.wait_for("reply") == [("reply", 10, None)]
    assert one.of("model")[-1][5] == two.of("model")[-1][5] == 2
