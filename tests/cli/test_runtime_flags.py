"""The runtime flags ``serve`` and ``bench`` both declare mean and validate the same in both
(they had drifted: ``--workers 0`` was refused by serve and taken by bench)."""

from __future__ import annotations

import argparse

import pytest

SHARED = (
    "--max-batch-size",
    "--max-batch-tokens",
    "--max-delay-ms",
    "--workers",
    "--no-latency-session",
    "--providers",
)


def _subparser(name: str) -> argparse.ArgumentParser:
    from ortbatch.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


@pytest.mark.parametrize("flag", SHARED)
def test_a_shared_flag_has_one_type_in_serve_and_bench(flag: str) -> None:
    serve, bench = _action(_subparser("serve"), flag), _action(_subparser("bench"), flag)
    assert serve.type is bench.type and type(serve) is type(bench)


@pytest.mark.parametrize("flag", ["--workers", "--max-batch-size", "--max-batch-tokens"])
@pytest.mark.parametrize("command", ["serve", "bench"])
def test_a_count_below_one_is_refused_by_both(command: str, flag: str, capsys) -> None:
    target = [] if command == "serve" else ["x"]
    with pytest.raises(SystemExit) as exc:
        _subparser(command).parse_args([*target, flag, "0"])
    assert exc.value.code == 2
    assert f"argument {flag}: must be a positive integer, got 0" in capsys.readouterr().err


def test_each_command_keeps_its_defaults() -> None:
    serve = _subparser("serve").parse_args([])
    bench = _subparser("bench").parse_args(["x"])
    assert (serve.max_batch_size, bench.max_batch_size) == (None, 32)
    assert serve.workers is bench.workers is None and serve.max_delay_ms == bench.max_delay_ms == 0.0
