"""Serving inference v2 over HTTP with OpenAI's API (``shardspeed serve``).

``protocol`` (request/response models), ``detokenizer`` (incremental text and stop strings),
``generation`` (one request between HTTP and the engine), ``app`` (the Starlette routes),
``server`` (model loading, uvicorn) and ``cli``. Starlette and uvicorn come with the ``serve``
extra (``pip install shardspeed[serve]``) and are imported only by ``app`` and ``server``.
"""

from shardspeed.inference.v2.serving.detokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    TextAssembler,
)

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "TextAssembler"]
