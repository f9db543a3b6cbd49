"""The image's entry point (deploy/docker/entrypoint.sh): which ``ortbatch serve`` command line
it runs for what is mounted, read from the script itself with a stand-in ``ortbatch``."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ortbatch.cli import build_parser

from .manifests import ENTRYPOINT, entrypoint_argv

PORTS = {"ORTBATCH_HTTP_PORT": "8000", "ORTBATCH_GRPC_PORT": "8001"}


def _mounted(tmp_path: Path, *files: str) -> Path:
    models = tmp_path / "models"
    models.mkdir()
    for name in files:
        (models / name).parent.mkdir(parents=True, exist_ok=True)
        (models / name).write_text("{}")
    return models


def test_one_export_is_served_under_the_given_name(tmp_path: Path) -> None:
    models = _mounted(tmp_path, "ortbatch.json")
    env = {**PORTS, "ORTBATCH_MODELS": str(models), "ORTBATCH_MODEL_NAME": "minilm"}
    args = build_parser().parse_args(entrypoint_argv(env, [], tmp_path))
    assert (args.directory, args.name, args.repository) == ([str(models)], "minilm", None)
    assert (args.host, args.port, args.grpc_port) == ("0.0.0.0", 8000, 8001)


def test_a_bare_onnx_is_one_model_named_model_by_default(tmp_path: Path) -> None:
    models = _mounted(tmp_path, "model.onnx")
    args = build_parser().parse_args(entrypoint_argv({**PORTS, "ORTBATCH_MODELS": str(models)}, [], tmp_path))
    assert (args.directory, args.name) == ([str(models)], "model")


def test_folders_of_exports_are_a_repository(tmp_path: Path) -> None:
    models = _mounted(tmp_path, "minilm/ortbatch.json", "gpt2/ortbatch.json")
    args = build_parser().parse_args(entrypoint_argv({**PORTS, "ORTBATCH_MODELS": str(models)}, [], tmp_path))
    assert (args.directory, args.repository, args.name) == ([], str(models), None)


def test_arguments_come_last_and_win_and_an_empty_grpc_port_turns_grpc_off(tmp_path: Path) -> None:
    models = _mounted(tmp_path, "ortbatch.json")
    env = {"ORTBATCH_MODELS": str(models), "ORTBATCH_HTTP_PORT": "9999", "ORTBATCH_GRPC_PORT": ""}
    argv = entrypoint_argv(env, ["--name", "mine", "--max-batch-size", "8"], tmp_path)
    args = build_parser().parse_args(argv)
    assert (args.name, args.max_batch_size, args.port, args.grpc_port) == ("mine", 8, 9999, None)
    assert "--grpc-port" not in argv


def test_nothing_mounted_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run(
        ["sh", str(ENTRYPOINT)],
        env={"PATH": "/usr/bin:/bin", "ORTBATCH_MODELS": str(tmp_path / "none")},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"ortbatch-entrypoint: error: nothing at {tmp_path / 'none'}: mount an export or a model repository there"
    )
