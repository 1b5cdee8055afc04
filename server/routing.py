"""Route spellings and route names: llama.cpp's paths without ``/v1``, and the route template a
request matched, which is what logs print instead of the path a client sent."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.routing import Mount

# llama.cpp's server answers the OpenAI routes without the /v1 prefix too; not ``/completions``,
# which is its native completion there (the ``/completion`` route), as here
PATH_ALIASES = {"/chat/completions": "/v1/chat/completions", "/models": "/v1/models"}
PREFIX_ALIASES = {"/models/": "/v1/models/"}
NO_ROUTE = "(no route)"


def canonical_path(path: str) -> str:
    """The ``/v1`` path a llama.cpp spelling stands for; any other path unchanged."""
    if path in PATH_ALIASES:
        return PATH_ALIASES[path]
    for prefix, target in PREFIX_ALIASES.items():
        if path.startswith(prefix):
            return target + path[len(prefix):]
    return path


class PathAliasMiddleware:
    """Rewrites an alias to its ``/v1`` path before anything else reads the path (auth, tracing,
    routing), so an alias behaves as its route in every respect."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] == "http":
            path = canonical_path(scope["path"])
            if path != scope["path"]:
                scope = {**scope, "path": path, "raw_path": path.encode()}
        await self.app(scope, receive, send)


def route_template(scope: dict[str, Any]) -> str:
    """The template of the route a request reached (``/v1/models/{model_id:path}``, ``/assets/*``)
    once routing has run on ``scope``, else ``(no route)``: a name that never holds what the client
    put in the path."""
    path = getattr(scope.get("route"), "path", None)
    if isinstance(path, str):
        return path
    app, asked = scope.get("app"), scope.get("path")
    for route in getattr(getattr(app, "router", None), "routes", ()):
        if isinstance(route, Mount) and isinstance(asked, str) and asked.startswith(route.path + "/"):
            return route.path + "/*"
    return NO_ROUTE
