"""The browser's routes: the chat page at `/` (off with `--no-ui`) and the API docs at `/docs`
(Swagger UI) and `/redoc`, whose scripts and styles come from the `fastapi-offline` package,
not a CDN, so they work on a machine without internet access.

All of them are static and served without the API key (OPEN_PATHS): a browser cannot add a
bearer header to a page it opens, and none of them holds data. The chat page asks for the key
and sends it only on its own API calls. `/openapi.json` is open too: it is the schema of the
routes, the same for every server of this version (it is built from the source, names no model
and tells nothing of the traffic), and the docs pages fetch it from the browser, so guarding it
would leave `/docs` blank on a server with a key. Every API route still needs the key.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Awaitable, Callable
from functools import cache
from importlib import resources
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

ASSET_PREFIX = "/docs/assets/"
DOC_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}
OPEN_PATHS = frozenset({"/", "/docs", "/redoc", "/openapi.json", *(ASSET_PREFIX + name for name in DOC_ASSETS)})
# The assets change only with the package's version: a day in the browser's cache is safe.
ASSET_CACHE_CONTROL = "public, max-age=86400"
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def _source_hash(html: str, tag: str) -> str:
    """The CSP source of the page's one inline `<tag>`, by its SHA-256: the page runs its own
    script and style and nothing else, not even a script that model text might smuggle in."""
    match = re.search(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
    assert match is not None, f"the chat page has no <{tag}>"
    digest = base64.b64encode(hashlib.sha256(match.group(1).encode()).digest()).decode()
    return f"'sha256-{digest}'"


def content_security_policy(html: str) -> str:
    """Nothing from elsewhere: only the page's own inline script and style, fetches to this
    server, no frames, no forms, no plugins, and no page may frame it."""
    return "; ".join(
        [
            "default-src 'none'",
            f"script-src {_source_hash(html, 'script')}",
            f"style-src {_source_hash(html, 'style')}",
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


@cache
def chat_html() -> str:
    """The page, read once from the package data."""
    return (Path(__file__).parent / "ui" / "chat.html").read_text(encoding="utf-8")


def chat_page() -> HTMLResponse:
    html = chat_html()
    headers = {"Content-Security-Policy": content_security_policy(html), "Cache-Control": "no-cache"}
    return HTMLResponse(html, headers={**headers, **SECURITY_HEADERS})


@cache
def doc_asset_bytes(name: str) -> bytes:
    """One of fastapi-offline's files (they total about 2.8 MB), read on first use."""
    return (resources.files("fastapi_offline") / "static" / name).read_bytes()


def doc_asset_route(name: str) -> Callable[[], Awaitable[Response]]:
    """The route of one asset: a fixed name, no parameter a request could set."""

    async def asset() -> Response:
        headers = {"Cache-Control": ASSET_CACHE_CONTROL, **SECURITY_HEADERS}
        return Response(doc_asset_bytes(name), media_type=DOC_ASSETS[name], headers=headers)

    return asset


def add_ui_routes(app: FastAPI, enable_ui: bool) -> None:
    """The chat page (if `enable_ui`), the docs pages and their assets; none in the schema.
    The app must be built with `docs_url=None, redoc_url=None` (FastAPI's own pages use a CDN)."""
    assert app.openapi_url is not None
    openapi_url = app.openapi_url

    if enable_ui:

        @app.get("/", include_in_schema=False)
        async def chat() -> HTMLResponse:
            return chat_page()

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=ASSET_PREFIX + "swagger-ui-bundle.js",
            swagger_css_url=ASSET_PREFIX + "swagger-ui.css",
            swagger_favicon_url=ASSET_PREFIX + "favicon.png",
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=ASSET_PREFIX + "redoc.standalone.js",
            redoc_favicon_url=ASSET_PREFIX + "favicon.png",
            with_google_fonts=False,
        )

    for name in DOC_ASSETS:
        app.add_api_route(ASSET_PREFIX + name, doc_asset_route(name), include_in_schema=False)
