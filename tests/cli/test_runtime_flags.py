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


NUMBERS = [
    # (command, flag, refused values, a value taken): seconds, rates and shares are finite
    # and positive; a delay, a grace period and a GPU share may be 0
    ("serve", "--max-delay-ms", ("-1", "nan", "inf"), "0"),
    ("bench", "--max-delay-ms", ("-1", "nan"), "2.5"),
    ("serve", "--timeout-s", ("0", "-1", "nan"), "30"),
    ("serve", "--graceful-timeout-s", ("-1", "nan"), "0"),
    ("serve", "--header-timeout-s", ("0", "-1", "nan"), "5"),
    ("serve", "--first-byte-timeout-s", ("0", "-3", "nan"), "1"),
    ("serve", "--body-timeout-s", ("0", "-1", "inf"), "60"),
    ("serve", "--replica-cpus", ("0", "-1", "nan"), "0.5"),
    ("serve", "--replica-gpus", ("-1", "nan"), "0"),
    ("serve", "--ray-request-timeout-s", ("0", "nan"), "10"),
    ("bench", "--duration", ("0", "-1", "nan"), "3"),
    ("bench", "--rate", ("0", "-2", "inf"), "50"),
    ("run", "--progress-every", ("0", "-1", "nan"), "0.5"),
    ("run", "--ray-cpus", ("0", "nan"), "2"),
    ("run", "--ray-gpus", ("-1", "nan"), "1"),
]


@pytest.mark.parametrize(("command", "flag", "refused", "taken"), NUMBERS)
def test_a_number_flag_refuses_what_it_cannot_mean_in_one_line(
    command: str, flag: str, refused: tuple[str, ...], taken: str, capsys
) -> None:
    # before, a negative --max-delay-ms was a traceback, NaN or negative timeouts started a
    # server whose connections then timed out at once (or crashed it at shutdown), and
    # --duration -1 ran a benchmark that measured nothing
    target = {"serve": [], "bench": ["x"], "run": ["export", "input", "-o", "out"]}[command]
    parser = _subparser(command)
    for value in refused:
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([*target, f"{flag}={value}"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: must be" in err and repr(value) in err, err
    parsed = parser.parse_args([*target, flag, taken])
    assert getattr(parsed, flag.lstrip("-").replace("-", "_")) == float(taken)
