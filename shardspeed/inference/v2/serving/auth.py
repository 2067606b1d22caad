"""API-key authentication, as OpenAI's own API and vLLM's ``--api-key`` check it: every request
carries ``Authorization: Bearer <key>`` except ``/health`` and ``/metrics`` (probes and
scrapers). Deny by default: a route added later, or a path reached under a ``root_path``, asks
for the key too."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import JSONResponse

from shardspeed.inference.v2.serving.protocol import error_body

__all__ = ["OPEN_PATHS", "APIKeyAuth"]

# what needs no key
OPEN_PATHS = frozenset({"/health", "/metrics"})


class APIKeyAuth:
    """ASGI middleware answering 401 (OpenAI's ``invalid_api_key`` error) to a request outside
    :data:`OPEN_PATHS` whose bearer token is not ``key`` (a websocket is closed, code 1008)."""

    def __init__(self, app: Any, key: str) -> None:
        if not key:
            raise ValueError("the API key is empty: give a non-empty key or none")
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and not self._allowed(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})  # policy violation
                return
            body = error_body(
                "Incorrect or missing API key: send the server's key as "
                "'Authorization: Bearer <key>' (the OpenAI client's api_key)",
                "invalid_request_error",
                None,
                "invalid_api_key",
            )
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Any) -> bool:
        """Whether the request may pass: an open path, or the right key."""
        path = str(scope.get("path", ""))
        root = str(scope.get("root_path", ""))
        if root and path.startswith(root):
            path = path[len(root) :]  # the path the routes see
        if path in OPEN_PATHS:
            return True
        given = b""
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                given = value
                break
        # constant time: the comparison must not tell how much of a guess was right
        return hmac.compare_digest(given, self._expected)
