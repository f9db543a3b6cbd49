"""ortbatch.ray without a running cluster: what build_app asks of Ray, and the CLI's
--ray flags checked before anything starts (no Ray here, so no network: see test_ray_serve)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortbatch.cli import main
from ortbatch.errors import OrtBatchError

pytest.importorskip("ray.serve")
pytest.importorskip("starlette")

from ortbatch.ray import build_app, replica_threads


def _export(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    return d


def test_one_deployment_per_export_with_the_replica_options(tmp_path: Path) -> None:
    a, b = _export(tmp_path, "enc"), _export(tmp_path, "dec")
    apps = build_app([a, b], replicas=3, ray_actor_options={"num_cpus": 2})
    assert [(x.name, x.route_prefix) for x in apps] == [("enc", "/enc"), ("dec", "/dec")]
    dep = apps[0].application._bound_deployment
    assert dep.name == "enc" and dep.num_replicas == 3
    assert dep.ray_actor_options["num_cpus"] == 2
    assert dep.max_ongoing_requests == 1024  # the session's queue bound, not Ray's 5
    (one,) = build_app(a, autoscaling={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8})
    assert one.route_prefix == "/"
    assert one.application._bound_deployment._deployment_config.autoscaling_config.max_replicas == 2


def test_threads_follow_the_replica_cpus() -> None:
    assert replica_threads(4, 2) == 2
    assert replica_threads(1, 2) == 1
    assert replica_threads(0.5, 1) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"replicas": 0}, "replicas must be at least 1"), ({}, "does not exist")],
)
def test_bad_arguments_name_what_was_wrong(tmp_path: Path, kwargs: dict, message: str) -> None:
    target = _export(tmp_path, "m") if kwargs else tmp_path / "missing"
    with pytest.raises(OrtBatchError, match=message):
        build_app(target, **kwargs)


def test_two_exports_of_one_name_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(OrtBatchError, match="same name"):
        build_app([_export(tmp_path / "a", "m"), _export(tmp_path / "b", "m")])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "2"], "--replicas needs --ray"),
        (["--ray-address", "auto"], "--ray-address needs --ray"),
        (["--ray", "--grpc-port", "8001"], "--grpc-port is not served through Ray"),
        (["--ray", "--port", "0"], "--ray needs a fixed --port"),
        (["--ray-request-timeout-s", "5"], "--ray-request-timeout-s needs --ray"),
    ],
)
def test_cli_refuses_ray_flags_that_cannot_work(tmp_path: Path, capsys, flags: list[str], message: str) -> None:
    assert main(["serve", str(_export(tmp_path, "m")), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--ray-request-timeout-s", "--replica-cpus", "--replica-gpus"])
def test_cli_refuses_a_ray_number_that_is_no_share_or_deadline_as_it_parses(tmp_path: Path, capsys, flag: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(_export(tmp_path, "m")), "--ray", "--port", "8000", flag, "nan"])
    assert exc.value.code == 2
    assert f"argument {flag}: must be a finite number, got 'nan'" in capsys.readouterr().err


def test_app_builder_for_config_files_and_kuberay(tmp_path: Path) -> None:
    from ortbatch.ray import app_builder

    d = _export(tmp_path, "enc")
    app = app_builder({"directory": str(d), "replicas": 2, "max_batch_size": 8, "timeout_s": 5.0})
    dep = app._bound_deployment
    assert dep.name == "enc" and dep.num_replicas == 2
    with pytest.raises(OrtBatchError, match=r"unknown args \['max_batch'\]"):
        app_builder({"directory": str(d), "max_batch": 8})
    with pytest.raises(OrtBatchError, match=r"needs args\.directory"):
        app_builder({})


def test_named_exports_keep_their_names(tmp_path: Path) -> None:
    apps = build_app([("first", _export(tmp_path, "a")), ("second", _export(tmp_path, "b"))])
    assert [(x.name, x.route_prefix) for x in apps] == [("first", "/first"), ("second", "/second")]


def test_cli_ray_refuses_a_missing_export_and_a_repository(tmp_path: Path, capsys) -> None:
    assert main(["serve", "--ray", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", "--ray", "--repository", str(tmp_path)]) == 2
    assert "--repository is not served on Ray" in capsys.readouterr().err


def test_a_replica_with_a_closed_session_fails_rays_health_check() -> None:
    """Ray calls the replica's ``check_health``; a closed session must fail it (Ray then
    replaces the replica) and an open one pass."""
    from types import SimpleNamespace

    from ortbatch.ray import _replica_class

    # the method Ray calls, on a stand-in for the replica (no replica context outside
    # Ray; an instance of Ray's wrapper class would leave an un-awaited async __del__)
    check_health = _replica_class().check_health
    check_health(SimpleNamespace(served=SimpleNamespace(name="m", ready=True, closed=False)))
    with pytest.raises(OrtBatchError, match="'m': its session is closed"):
        check_health(SimpleNamespace(served=SimpleNamespace(name="m", ready=False, closed=True)))


def test_deployment_options_reach_ray_and_cannot_override_build_apps_own(tmp_path: Path) -> None:
    d = _export(tmp_path, "enc")
    (app,) = build_app(d, deployment_options={"health_check_period_s": 2, "graceful_shutdown_timeout_s": 7})
    dep = app.application._bound_deployment
    assert dep._deployment_config.health_check_period_s == 2
    assert dep._deployment_config.graceful_shutdown_timeout_s == 7
    with pytest.raises(OrtBatchError, match=r"deployment_options \['num_replicas'\]"):
        build_app(d, deployment_options={"num_replicas": 3})


def test_serve_on_ray_gives_the_proxy_its_request_timeout_and_stops_on_sigterm(tmp_path: Path, monkeypatch) -> None:
    """What ``ortbatch serve --ray --ray-request-timeout-s`` asks of Ray, with Ray's calls
    recorded instead of made (a real Ray needs the loopback-only namespace: test_ray_serve)."""
    import os
    import signal

    import ray
    from ray import serve

    import ortbatch.ray as ortbatch_ray

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(("init", kw.get("address"))))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("ray.shutdown", None)))
    monkeypatch.setattr(serve, "start", lambda **kw: calls.append(("start", kw["http_options"])))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append(("serve.shutdown", None)))

    def deployed(apps: list) -> None:
        calls.append(("run", [a.name for a in apps]))
        os.kill(os.getpid(), signal.SIGTERM)  # what stops the server: its handler sets the stop event

    monkeypatch.setattr(ortbatch_ray, "run", deployed)
    previous = signal.getsignal(signal.SIGTERM)
    argv = ["serve", "--ray", "--port", "8123", "--ray-request-timeout-s", "7.5", str(_export(tmp_path, "m"))]
    assert main(argv) == 0
    assert calls == [
        ("init", None),
        ("start", {"host": "127.0.0.1", "port": 8123, "request_timeout_s": 7.5}),
        ("run", ["m"]),
        ("serve.shutdown", None),
        ("ray.shutdown", None),
    ]
    assert signal.getsignal(signal.SIGTERM) == previous
