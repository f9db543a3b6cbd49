"""Issue 26 item 10: a mistyped flag gets the subcommand's usage and a suggestion."""

from __future__ import annotations

import pytest

from ortbatch.cli import main


def test_a_mistyped_flag_prints_the_subcommands_usage_and_a_suggestion(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--prot", "1"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "usage: ortbatch serve" in err and "did you mean --port?" in err, err
    assert "Traceback" not in err


def test_an_unknown_top_level_flag_is_still_the_top_levels_mistake(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--bogus"])
    assert info.value.code == 2
    assert "usage: ortbatch [" in capsys.readouterr().err
