"""The web files without a browser: every referenced file exists, is served, and only pages are public."""
from __future__ import annotations

import re
from urllib.parse import urljoin, urlsplit

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ninfer.server import web

HTML_REF = re.compile(r'''(?:src|href)="([^"#?:]+)"''')
JS_IMPORT = re.compile(r'''(?:^|\n)\s*import\b[^"';]*?["'](\.{1,2}/[^"']+)["']''')


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    web.install(app)
    return TestClient(app)


def local_references(file):
    pattern = HTML_REF if file.suffix == ".html" else JS_IMPORT
    for ref in pattern.findall(file.read_text()):
        if not ref.startswith(("http", "//", "mailto")):
            yield ref


def test_every_referenced_file_exists_and_is_served(client):
    """Follow the pages' src/href and the modules' imports, as a browser would."""
    todo = [("/", web.WEB_DIR / "index.html"), ("/monitor/", web.WEB_DIR / "monitor" / "index.html")]
    seen: set[str] = set()
    while todo:
        url, file = todo.pop()
        response = client.get(url)
        assert response.status_code == 200, url
        if file.suffix not in (".html", ".js"):
            continue
        for ref in local_references(file):
            if ref.endswith("/"):  # a link to a page
                assert client.get(urlsplit(urljoin("http://server" + url, ref)).path).status_code == 200, ref
                continue
            target = (file.parent / ref).resolve()
            assert target.is_file(), f"{file.name} refers to a missing {ref}"
            child = urlsplit(urljoin("http://server" + url, ref)).path
            if child not in seen:
                seen.add(child)
                todo.append((child, target))
    assert any(u.endswith("marked.esm.js") for u in seen) and any(u.endswith("highlight.min.js") for u in seen)
    assert client.get("/assets/js/api.js").headers["content-type"].startswith("text/javascript")


def test_vendored_libraries_keep_their_licenses():
    for lib in (web.WEB_DIR / "vendor").iterdir():
        if lib.is_dir():
            assert (lib / "LICENSE").is_file(), f"web/vendor/{lib.name} has no LICENSE"


def test_only_pages_and_assets_are_public():
    for path in ("/", "/monitor/", "/monitor", "/assets/js/api.js", "/vendor/marked/marked.esm.js", "/favicon.ico"):
        assert web.is_public(path), path
    for path in ("/v1/models", "/v1/chat/completions", "/stats", "/metrics", "/assetsx", "/index.html"):
        assert not web.is_public(path), path


def test_monitor_without_slash_redirects(client):
    response = client.get("/monitor", follow_redirects=False)
    assert response.status_code == 308
    assert response.headers["location"] == "monitor/"
