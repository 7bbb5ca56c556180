"""/docs and /redoc work offline: every file they load comes from this server (fastapi-offline's assets).

A real uvicorn server (tests/e2e/live.py); the pages are read as a browser would: every src/href and the
spec URL are fetched back from the same server.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.live import live_server

pytestmark = pytest.mark.timeout(120)
PAGES = ("/docs", "/redoc")
_REFERENCE = re.compile(r"""(?:src|href|spec-url)\s*=\s*["']([^"']+)["']|\burl:\s*["']([^"']+)["']""")


@pytest.fixture(scope="module")
def srv():
    with live_server() as live:
        yield live


def references(html: str) -> list[str]:
    """Every URL the page itself loads: script/link/icon targets and the OpenAPI spec."""
    return [a or b for a, b in _REFERENCE.findall(html)]


@pytest.mark.parametrize("page", PAGES)
def test_docs_page_loads_only_assets_from_this_server(srv, page):
    with srv.client() as c:
        r = c.get(page)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/html")
        off_server = [u for u in re.findall(r"https?://[^\s\"'<>]+", r.text) if not u.startswith(srv.url)]
        assert off_server == [], off_server
        refs = references(r.text)
        assert "/openapi.json" in refs
        assert any(u.endswith(".js") for u in refs), refs
        for url in refs:
            assert url.startswith("/"), url  # same origin
            asset = c.get(url)
            assert asset.status_code == 200, url
            assert len(asset.content) > 0, url


def test_swagger_ui_sends_the_spec_to_no_online_validator(srv):
    with srv.client() as c:
        assert '"validatorUrl": null' in c.get("/docs").text


def test_references_are_found_in_a_known_page():
    html = (
        '<link href="/a.css"><script src="/b.js"></script><redoc spec-url="/s.json"></redoc>url: \'/o.json\','
    )
    assert references(html) == ["/a.css", "/b.js", "/s.json", "/o.json"]


def test_with_an_api_key_the_docs_and_their_assets_need_it():
    """Like /openapi.json (tests/e2e/test_api_security.py, the API key): only /health is open."""
    with live_server(api_key="s3cret") as srv, srv.client() as c:
        good = {"Authorization": "Bearer s3cret"}
        html = c.get("/docs", headers=good)
        assert html.status_code == 200
        for url in ["/docs", "/redoc", *references(html.text)]:
            assert c.get(url).status_code == 401, url
            assert c.get(url, headers=good).status_code == 200, url
