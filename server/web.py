"""The browser UI: the chat page at ``/``, the monitor at ``/monitor/`` and their static files.

The pages and their assets are public (no API key): a page takes the key from its ``?key=`` link
and sends it as a bearer token on the API calls it makes, which stay protected.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
PAGES = {"/": WEB_DIR / "index.html", "/monitor/": WEB_DIR / "monitor" / "index.html"}
ASSET_DIRS = {"/assets": WEB_DIR / "assets", "/vendor": WEB_DIR / "vendor"}
PUBLIC_PATHS = frozenset([*PAGES, "/monitor", "/favicon.ico"])
PUBLIC_PREFIXES = tuple(prefix + "/" for prefix in ASSET_DIRS)

# A page is re-fetched on every visit so that a restarted, upgraded server is picked up at once.
_NO_CACHE = {"Cache-Control": "no-cache"}


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def install(app: FastAPI) -> None:
    for route, file in PAGES.items():
        app.add_api_route(route, _page(file), methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/monitor", lambda: RedirectResponse("monitor/", status_code=308),
                      methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/favicon.ico", lambda: FileResponse(WEB_DIR / "assets" / "icon.svg",
                                                           media_type="image/svg+xml"),
                      methods=["GET", "HEAD"], include_in_schema=False)
    for prefix, directory in ASSET_DIRS.items():
        app.mount(prefix, _Assets(directory=directory), name=prefix.strip("/"))


def _page(file: Path):
    async def page() -> FileResponse:
        return FileResponse(file, media_type="text/html", headers=_NO_CACHE)
    return page


class _Assets(StaticFiles):
    """Static files, revalidated on each load (cheap: 304 by ETag) so that an upgrade shows at once."""

    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        response.headers.setdefault("Cache-Control", "no-cache")
        if path.endswith((".js", ".mjs")):
            response.headers["Content-Type"] = "text/javascript; charset=utf-8"
        return response
