"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``): the reference pages are
generated from the code at each build, never kept by hand.

A page holds a marker ``<!-- generated:NAME -->`` on a line of its own; the hook puts in its
place what :data:`GENERATORS` makes of NAME:

* ``cli``: every ``ortbatch`` subcommand's ``--help``, from the argparse parsers themselves;
* ``http-api``: the operations of the server's own OpenAPI document (the code behind
  ``GET /openapi.json``), listing every operation any served model can mount;
* ``parameters``: the request parameter table (``parameter_table()``, as
  scripts/parameter-table.sh writes it into docs/serving.md);
* ``manifest-fields``: the fields of ``ortbatch.json`` from the Manifest dataclass.

Links out of docs/ to the repository's own files (``../deploy/README.md``) have no page on the
site: they become the file's path in code, so ``mkdocs build --strict`` checks every link
that stays a link.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_MARKER = re.compile(r"^<!-- generated:([\w-]+) -->$", re.MULTILINE)
_OUTSIDE = re.compile(r"\[([^\]]+)\]\((\.\./[^)#\s]+)(#[^)]*)?\)")


def _cli() -> str:
    import argparse

    from ortbatch.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: one width for the page
    parser = build_parser()
    out = ["## ortbatch", "", "```text", parser.format_help().rstrip(), "```", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sorted(sub.choices.items()):
        out += [f"## ortbatch {name}", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def _http_api() -> str:
    from ortbatch.serve.http.openapi import ApiFacts, document
    from ortbatch.serve.http.openapi_schemas import OPERATIONS

    facts = ApiFacts("ortbatch")
    for op in OPERATIONS:
        facts.list(op, ["MODEL"])
    doc = document(facts)
    by_tag: dict[str, list[str]] = {}
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            ref = body.get("$ref", "").rsplit("/", 1)[-1]
            tag = (op.get("tags") or ["other"])[0]
            by_tag.setdefault(tag, []).append(
                f"| `{method.upper()}` | `{path}` | {op.get('summary', '')} | {f'`{ref}`' if ref else ''} |"
            )
    out = []
    for tag, rows in by_tag.items():
        out += [f"## {tag}", "", "| method | path | what | request body |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


def _parameters() -> str:
    from ortbatch.serve.served.parameters import parameter_table

    return parameter_table()


def _manifest_fields() -> str:
    from ortbatch.manifest import InputSpec, Manifest, OutputSpec

    out = []
    for cls in (Manifest, InputSpec, OutputSpec):
        out += [f"### `{cls.__name__}`", "", "| field | type | default |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.name == "directory":
                continue  # where it was read from: not written to ortbatch.json
            if f.default is not dataclasses.MISSING:
                default = f"`{f.default!r}`"
            elif f.default_factory is not dataclasses.MISSING:
                default = f"`{f.default_factory()!r}`"
            else:
                default = "required"
            out.append(f"| `{f.name}` | `{f.type}` | {default} |")
        out.append("")
    return "\n".join(out)


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": _cli,
    "http-api": _http_api,
    "parameters": _parameters,
    "manifest-fields": _manifest_fields,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def generate(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            return m.group(0)  # docs/benchmarks.md's markers are benchmarks/peers.py's
        with redirect_stdout(io.StringIO()):
            return GENERATORS[name]()

    markdown = _MARKER.sub(generate, markdown)
    docs = Path(config["docs_dir"]).resolve()
    here = (docs / page.file.src_path).parent

    def outside(m: re.Match[str]) -> str:
        target = (here / m.group(2)).resolve()
        if target.is_relative_to(docs):
            return m.group(0)  # a page of the site: mkdocs checks it
        return f"{m.group(1)} (`{target.relative_to(REPO)}` in the repository)"

    return _OUTSIDE.sub(outside, markdown)
