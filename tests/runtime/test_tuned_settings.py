"""BatchedSession takes the settings ``ortbatch tune`` wrote into the manifest, unless told otherwise."""

from __future__ import annotations

import json

import pytest

from ortbatch import BatchedSession, ManifestError
from tests.runtime.test_manifest_driven import write_export


def _tune(tmp_path, runtime) -> None:
    path = tmp_path / "ortbatch.json"
    data = json.loads(path.read_text())
    data["runtime"] = runtime
    path.write_text(json.dumps(data))


def test_tuned_settings_are_the_defaults(tmp_path, echo_path):
    write_export(tmp_path, echo_path, "right")
    _tune(tmp_path, {"workers": 1, "max_batch_size": 8, "max_batch_tokens": 256})
    with BatchedSession(str(tmp_path)) as bs:
        assert (bs.workers, bs.max_batch_size, bs._policy.max_tokens) == (1, 8, 256)
    with BatchedSession(str(tmp_path), workers=2, max_batch_size=4, max_batch_tokens=64) as bs:
        assert (bs.workers, bs.max_batch_size, bs._policy.max_tokens) == (2, 4, 64)


def test_untuned_export_keeps_the_old_defaults(tmp_path, echo_path):
    write_export(tmp_path, echo_path, "right")
    with BatchedSession(str(tmp_path)) as bs:
        assert (bs.workers, bs.max_batch_size, bs._policy.max_tokens) == (2, 16, None)  # 16: the export's limit


def test_bad_tuned_settings_are_a_manifest_error(tmp_path, echo_path):
    write_export(tmp_path, echo_path, "right")
    _tune(tmp_path, {"workers": "two"})
    with pytest.raises(ManifestError, match=r"runtime\.workers"):
        BatchedSession(str(tmp_path))
