"""Reads the history rows of an offline W&B run file (``run-<id>.wandb``).

The file is a LevelDB-style log (32 KiB blocks; records with a 7-byte header: crc32, length,
type) after a 7-byte W&B header; each record is a ``wandb_internal_pb2.Record``. Recent wandb
releases moved their own reader to the Go core, so the test carries this small one.
"""

from __future__ import annotations

import json
import struct

_BLOCK = 32768
_FILE_HEADER = 7
_RECORD_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file")
    pos, out, pending = _FILE_HEADER, [], b""
    while pos + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD_HEADER:
            pos += left_in_block  # block trailer padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _RECORD_HEADER])
        chunk = data[pos + _RECORD_HEADER : pos + _RECORD_HEADER + length]
        pos += _RECORD_HEADER + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
            pending = b""
        else:
            break  # zero padding at the end of a block that was never filled
    return out


def history_rows(path: str) -> list[dict[str, object]]:
    """Each logged history row as ``{key: value}`` (``_step`` included)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as handle:
        data = handle.read()
    rows = []
    for payload in _payloads(data):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows
