"""Issue 46, acceptance 1: the documentation site builds with ``mkdocs build --strict`` and works
in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright, which never
downloads a browser here) opens the landing page and three guides (screenshots kept under the
test's tmp dir), the search box finds "TensorRT", and no page of the site links to an anchor
that its target page does not have. The reference pages are generated from the code: the CLI
page holds every subcommand's real ``--help``."""

from __future__ import annotations

import functools
import html.parser
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlparse

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
STEP_MS = 60_000

pytestmark = pytest.mark.slow


class _Links(html.parser.HTMLParser):
    """The ids a page defines and the hrefs it links to."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if tag == "a" and name == "href" and value:
                self.hrefs.append(value)


def _parse(path: Path) -> _Links:
    links = _Links()
    links.feed(path.read_text(encoding="utf-8"))
    return links


def test_no_page_links_to_a_missing_page_or_anchor(site: Path) -> None:
    pages = {p: _parse(p) for p in site.rglob("*.html")}
    assert len(pages) > 20
    broken = []
    for page, links in pages.items():
        for href in links.hrefs:
            url = urlparse(href)
            if url.scheme or href.startswith("mailto:"):
                continue  # outside the site
            if url.path.startswith("/"):  # 404.html links from the site's root
                target = (site / unquote(url.path).lstrip("/")).resolve()
            else:
                target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if target.is_dir():
                target = target / "index.html"
            if target.suffix != ".html":
                if not target.exists():
                    broken.append(f"{page.relative_to(site)}: {href} (no such file)")
                continue
            if target not in pages:
                broken.append(f"{page.relative_to(site)}: {href} (no such page)")
            elif url.fragment and unquote(url.fragment) not in pages[target].ids:
                broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert not broken, "\n".join(broken)


def test_the_cli_reference_is_every_subcommands_own_help(site: Path) -> None:
    from ortbatch.cli import build_parser

    text = (site / "reference" / "cli.html").read_text(encoding="utf-8")
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for name in commands:
        assert f"usage: ortbatch {name}" in text, name
    assert "--max-batch-size" in text and "--progress-every" in text


@pytest.fixture(scope="module")
def served_site(site: Path) -> Iterator[str]:
    # over HTTP, as a user's browser reads it: the search index is fetched by a web worker
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package (dev extra) is not installed")
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"{CHROMIUM} is missing (Debian's chromium package: apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


@pytest.mark.parametrize(
    ("path", "heading"),
    [
        ("index.html", "ortbatch"),
        ("guides/embeddings.html", "Embeddings"),
        ("guides/llms.html", "LLMs: the OpenAI API, structured output, tools"),
        ("guides/gpu.html", "Your own model on a GPU"),
    ],
)
def test_the_landing_page_and_guides_render(served_site: str, browser: Any, tmp_path: Path, path: str, heading: str):
    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    page.set_default_timeout(STEP_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(urljoin(served_site, path))
    assert page.locator("article h1").first.inner_text().strip().rstrip("¶").strip() == heading
    assert page.locator("nav.md-nav").count() > 0  # the site's map is there
    shot = tmp_path / (path.replace("/", "-") + ".png")
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    assert not errors, errors
    page.close()


def test_the_search_box_finds_tensorrt(served_site: str, browser: Any, tmp_path: Path) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(STEP_MS)
    page.goto(served_site + "index.html")
    box = page.locator("input.md-search__input")
    box.click()  # the header's search box (at this width it is shown; narrower, behind an icon)
    # the index loads in a web worker; a query typed before it is ready is not answered
    meta = page.locator(".md-search-result__meta")
    page.wait_for_function("m => !m.textContent.includes('Initializing')", arg=meta.element_handle())
    box.press_sequentially("TensorRT", delay=50)  # typed, as a user does: the search listens to keys
    results = page.locator(".md-search-result__item")
    results.first.wait_for()
    page.screenshot(path=str(tmp_path / "search.png"))
    found = results.all_inner_texts()
    assert any("TensorRT" in text for text in found), found
    # a result leads to a page that says it
    page.locator(".md-search-result__item a").first.click()
    page.wait_for_load_state()
    assert "TensorRT" in page.locator("article").inner_text()
    page.close()
