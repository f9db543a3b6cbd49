"""/docs in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright;
Playwright never downloads a browser here) opens the Swagger UI page of a running
``ortbatch serve``, the page lists every operation of the OpenAPI document, and "Try it
out" on ``/v1/embeddings`` answers 200 with an embedding. With ``--api-key`` the page asks
for the key (Swagger UI's Authorize dialog) and works once it is given. Each test saves a
screenshot under its pytest tmp dir.

.ci/run installs ``chromium`` (apt) and the ``playwright`` package (the dev extra)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "browser-test-key"
#: milliseconds the page may take for any one step (a loaded CI machine, a 1.5 MB script)
STEP_MS = 60_000

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package (dev extra) is not installed")
if shutil.which(CHROMIUM) is None:
    pytest.skip(f"{CHROMIUM} is missing (Debian's chromium package: apt-get install chromium)", allow_module_level=True)

pytestmark = pytest.mark.slow


def _page_operations(page: Any) -> set[tuple[str, str]]:
    blocks = page.locator(".opblock .opblock-summary")
    methods = blocks.locator(".opblock-summary-method").all_inner_texts()
    paths = blocks.locator(".opblock-summary-path").all_inner_texts()
    # Swagger UI puts a zero-width space after each "/" of a long path, to wrap it
    return {(m.strip().upper(), p.replace("\u200b", "").strip()) for m, p in zip(methods, paths, strict=True)}


def _document_operations(url: str, key: str | None) -> set[tuple[str, str]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    doc = httpx.get(url + "/openapi.json", headers=headers, timeout=30).json()
    return {(m.upper(), p) for p, item in doc["paths"].items() for m in item}


def _try_embeddings(page: Any) -> tuple[str, Any]:
    """Open /v1/embeddings, press "Try it out" and "Execute" on its example; the answer's
    status and body as the page shows them."""
    block = page.locator("#operations-OpenAI-post_v1_embeddings")
    block.locator(".opblock-summary").click()
    block.locator("button.try-out__btn").click()
    block.locator("button.execute").click()
    status = block.locator(".live-responses-table tbody .response-col_status").first
    status.wait_for(timeout=STEP_MS)
    body = block.locator(".live-responses-table tbody .highlight-code code").first.inner_text(timeout=STEP_MS)
    return status.inner_text().strip(), json.loads(body)


def _open_docs(browser: Any, url: str, shot: Path, key: str | None) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 1600})
    page.set_default_timeout(STEP_MS)
    page.goto(url + "/docs")
    if key is not None:
        # the document needs the key: the page offers Swagger UI's Authorize and nothing else
        page.locator(".info .description").get_by_text("needs an API key").wait_for()
        assert page.locator(".opblock").count() == 0
        page.get_by_role("button", name="Authorize").click()
        page.locator(".auth-container input").first.fill(key)
        page.locator(".auth-btn-wrapper button.authorize").click()
        page.locator(".auth-btn-wrapper button.btn-done").click()
    page.locator(".opblock").first.wait_for()
    listed = _page_operations(page)
    assert listed == _document_operations(url, key)
    assert ("POST", "/v1/embeddings") in listed and ("GET", "/v2/health/ready") in listed
    status, answer = _try_embeddings(page)
    page.screenshot(path=str(shot), full_page=True)
    assert status == "200", f"Try it out answered {status}: {answer}"
    (row,) = answer["data"]
    assert row["object"] == "embedding" and len(row["embedding"]) > 0
    assert all(isinstance(x, float) for x in row["embedding"])
    page.close()


@pytest.fixture(scope="module")
def browser() -> Any:
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


def test_the_docs_page_lists_every_route_and_try_it_out_embeds(serve_process, encoder_dir, browser, tmp_path):
    server = serve_process(str(encoder_dir), "--name", "tiny")
    shot = tmp_path / "docs.png"
    _open_docs(browser, server.url, shot, key=None)
    assert shot.stat().st_size > 10_000


def test_with_an_api_key_the_page_asks_for_it_and_works_with_it(serve_process, encoder_dir, browser, tmp_path):
    server = serve_process(str(encoder_dir), "--name", "tiny", "--api-key", KEY)
    assert httpx.get(server.url + "/openapi.json", timeout=30).status_code == 401
    shot = tmp_path / "docs-with-key.png"
    _open_docs(browser, server.url, shot, key=KEY)
    assert shot.stat().st_size > 10_000


def test_a_wrong_key_is_refused_and_the_page_says_so(serve_process, encoder_dir, browser, tmp_path):
    server = serve_process(str(encoder_dir), "--name", "tiny", "--api-key", KEY)
    page = browser.new_page()
    page.set_default_timeout(STEP_MS)
    page.goto(server.url + "/docs")
    page.get_by_role("button", name="Authorize").click()
    page.locator(".auth-container input").first.fill("not-the-key")
    page.locator(".auth-btn-wrapper button.authorize").click()
    page.locator(".auth-btn-wrapper button.btn-done").click()
    page.locator(".info .description").get_by_text("That key was refused").wait_for()
    page.screenshot(path=str(tmp_path / "docs-wrong-key.png"), full_page=True)
    assert page.locator(".opblock").count() == 0
    page.close()
