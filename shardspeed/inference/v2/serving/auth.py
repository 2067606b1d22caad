"""API-key authentication for the OpenAI routes, as OpenAI's own API and vLLM's
``--api-key`` check it: every ``/v1/...`` request carries ``Authorization: Bearer <key>``;
``/health`` and ``/metrics`` stay open (probes and scrapers)."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import JSONResponse

from shardspeed.inference.v2.serving.protocol import error_body

__all__ = ["APIKeyAuth"]


class APIKeyAuth:
    """ASGI middleware answering 401 (OpenAI's ``invalid_api_key`` error) to a ``/v1`` request
    whose bearer token is not ``key``."""

    def __init__(self, app: Any, key: str) -> None:
        if not key:
            raise ValueError("the API key is empty: give a non-empty key or none")
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = b""
            for name, value in scope.get("headers") or ():
                if name.lower() == b"authorization":
                    given = value
                    break
            # constant time: the comparison must not tell how much of a guess was right
            if not hmac.compare_digest(given, self._expected):
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
