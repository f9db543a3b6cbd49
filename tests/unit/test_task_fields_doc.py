"""docs/serving.md's table of the fields each embedding and task endpoint reads is
``TASK_FIELDS`` (a field added to one and not the other fails here)."""

from __future__ import annotations

import re
from pathlib import Path

from ortbatch.serve.served.task_fields import TASK_FIELDS

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def test_the_docs_table_lists_each_endpoints_fields() -> None:
    text = DOC.read_text()
    table = text[text.index("### Request fields of the embedding and task endpoints") :]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `(/[^`]+)` \| (.*) \|$", line)
        if m:
            rows[m[1]] = set(re.findall(r"`([a-z_]+)`", m[2]))
        elif rows and not line.startswith("|"):
            break
    assert rows == {endpoint: set(fields) for endpoint, fields in TASK_FIELDS.items()}


def test_the_openapi_request_schemas_are_the_fields_each_endpoint_takes() -> None:
    from ortbatch.serve.http.openapi_schemas import OPERATIONS, SCHEMAS

    # read by the endpoint only to refuse them with a reason, so not in the schema
    refused = {
        "/v1/embeddings": {"top_k", "threshold"},
        "/embed": {"top_k", "threshold", "encoding_format"},
        "/embed_sparse": {"dimensions", "encoding_format"},
        "/tokenize": {"prompt_name"},
    }
    for endpoint, fields in TASK_FIELDS.items():
        schema = SCHEMAS[OPERATIONS[("POST", endpoint)].request]
        assert schema["additionalProperties"] is False, endpoint
        assert set(schema["properties"]) == {"model"} | (fields - refused.get(endpoint, set())), endpoint
