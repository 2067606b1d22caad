"""The job's ``{host: [slot ids]}`` as one shell-safe token, handed from the runner to each node.

DeepSpeed passes this as ``--world_info=<urlsafe base64 of JSON>``; the node launcher finds its own
slots by node rank, which is the host's position in the mapping.
"""

from __future__ import annotations

import base64
import binascii
import json

from shardspeed.launcher.resources import Resources


def encode_world_info(resources: Resources) -> str:
    """URL-safe base64 of the JSON mapping (no characters a shell or pdsh would rewrite)."""
    return base64.urlsafe_b64encode(json.dumps(resources).encode("utf-8")).decode("ascii")


def decode_world_info(token: str) -> Resources:
    """Inverse of :func:`encode_world_info`; raises ``ValueError`` for anything malformed."""
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
    except (binascii.Error, UnicodeError, ValueError) as exc:
        raise ValueError(
            f"--world_info {token[:40]!r} is not an encoded host/slot map ({exc}); it is "
            "written by the shardspeed runner, do not craft it by hand"
        ) from None
    if not isinstance(data, dict) or not all(
        isinstance(h, str) and isinstance(s, list) and all(isinstance(i, int) for i in s)
        for h, s in data.items()
    ):
        raise ValueError("--world_info must encode a JSON object of host -> list of slot ids")
    if not data:
        raise ValueError("--world_info encodes no host; the job has nothing to run on")
    return data
