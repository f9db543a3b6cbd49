"""``ortbatch serve`` uses the runtime settings ``ortbatch tune`` wrote, unless its flags set them."""

from __future__ import annotations

import json

from tinymodels import build_encoder

from ortbatch.commands.serve import add_arguments
from ortbatch.serve import ServeConfig, ServedModel


def test_serve_takes_the_tuned_settings_unless_flags_say_otherwise(tmp_path):
    import argparse

    d = build_encoder(tmp_path / "enc", max_batch_size=16)
    data = json.loads((d / "ortbatch.json").read_text())
    data["runtime"] = {"workers": 1, "max_batch_size": 8, "max_batch_tokens": 128}
    (d / "ortbatch.json").write_text(json.dumps(data))

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([str(d)]).max_batch_size is None  # the flag's default defers to the export

    model = ServedModel.load(d, session_kwargs=ServeConfig().session_kwargs())
    try:
        bs = model.session
        assert (bs.workers, bs.max_batch_size, bs._policy.max_tokens) == (1, 8, 128)
    finally:
        model.close()
    model = ServedModel.load(d, session_kwargs=ServeConfig(max_batch_size=4, workers=2).session_kwargs())
    try:
        assert (model.session.workers, model.session.max_batch_size) == (2, 4)
    finally:
        model.close()
