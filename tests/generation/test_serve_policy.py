"""The parameter policy itself: docs/serving.md's table is the policy's, every sampling parameter
has its row, neutral values are taken by type, refused fields (the deprecated ``functions`` among
them) are refused on both APIs even when lenient, and ``ortbatch serve --lenient-params`` accepts
unknown fields, logging each name once. The structured fields' mapping: test_serve_structured.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortbatch.errors import InvalidInputError
from ortbatch.generation.sampling import PARAMETERS
from ortbatch.serve.served.parameters import CHAT, COMPLETIONS, FIELDS, ParameterPolicy, parameter_table

from .conftest import TinyModel

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def test_the_docs_table_is_the_policy() -> None:
    text = DOCS.read_text()
    begin = text.index("\n", text.index("<!-- parameters:begin")) + 1
    table = text[begin : text.index("<!-- parameters:end -->")]
    assert table == parameter_table(), "docs/serving.md's parameter table is stale: run scripts/parameter-table.sh"


def test_every_sampling_parameter_has_a_row() -> None:
    """A parameter added to SamplingParams must be placed in the policy (max_new_tokens is max_tokens;
    the constraints are what the structured fields map to: structured_output answers those)."""
    constraints = {"json_schema", "json_object", "regex", "choice", "grammar"}
    assert set(PARAMETERS) - {"max_new_tokens"} - constraints <= set(FIELDS)


@pytest.mark.parametrize(
    ("doc", "refused"),
    [
        ({"priority": 0}, None),
        ({"priority": False}, "priority"),  # False == 0, but it is not the neutral value
        ({"length_penalty": 1}, None),
        ({"length_penalty": True}, "length_penalty"),
        ({"use_beam_search": None}, None),
        ({"length_penalty": 1.0}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, None),  # mapped (structured_output), not refused
        ({"tool_choice": "none", "tools": []}, None),
        ({"functions": []}, None),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"guided_decoding_backend": "guidance"}, None),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"max_completion_tokens": 3}, "max_completion_tokens"),  # chat's own: unknown to completions
        ({"user": "x", "cache_salt": "s"}, None),
    ],
)
def test_completions_policy(doc: dict, refused: str | None) -> None:
    if refused is None:
        ParameterPolicy().check(doc, COMPLETIONS)
        return
    with pytest.raises(InvalidInputError) as err:
        ParameterPolicy().check(doc, COMPLETIONS)
    assert err.value.input_name == refused and refused in str(err.value)


def test_chat_policy_neutral_values() -> None:
    ParameterPolicy().check({"store": False, "modalities": ["text"], "service_tier": "auto"}, CHAT)
    for doc in ({"store": 0}, {"modalities": ["text", "audio"]}, {"service_tier": "flex"}):
        with pytest.raises(InvalidInputError, match="is not supported"):
            ParameterPolicy().check(doc, CHAT)


@pytest.mark.parametrize("api", [COMPLETIONS, CHAT])
def test_lenient_takes_unknown_fields_but_never_structured_or_refused_ones(api: str) -> None:
    lenient = ParameterPolicy(lenient=True)
    lenient.check({"grammar": "x", "x_vendor": 1}, api)
    for doc, name in (
        ({"functions": [{}]}, "functions"),
        ({"structural_tag": "{}"}, "structural_tag"),
        ({"use_beam_search": True}, "use_beam_search"),
    ):
        with pytest.raises(InvalidInputError, match=f"'{name}' is not supported"):
            lenient.check(doc, api)
    with pytest.raises(InvalidInputError, match="Unrecognized request argument supplied: grammar"):
        ParameterPolicy().check({"grammar": "x"}, api)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_lenient_params_logs_each_unknown_field_once(tiny_gpt2: TinyModel, tmp_path: Path) -> None:
    httpx = pytest.importorskip("httpx")
    from .test_lm_eval import Serve

    server = Serve(tiny_gpt2.export, tmp_path / "serve.log", "--lenient-params")
    try:
        for _ in range(3):
            for field in ("grammar", "x_vendor"):
                body = {"prompt": [5, 6], "max_tokens": 2, field: 1}
                r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5], "suffix": "x"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    for field in ("grammar", "x_vendor"):
        assert log.count(f"ignoring the unrecognized request field '{field}'") == 1, log
