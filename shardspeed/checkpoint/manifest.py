"""The per-tag manifest: every file of a checkpoint tag, its size and checksum, written last.

``save_dir/<tag>/manifest.json`` lists each file of the tag (its path inside the tag folder, its
size in bytes, the CRC-32 of its bytes). It is written once every rank's files are durably on
disk, and the tag is moved into place and named in ``latest`` only after it, so a tag with a
manifest is complete. :func:`check_tag` checks a tag against it before anything is loaded:
a listed file that is missing or of another size is named in the error, never read as a partial
checkpoint; with ``verify_checksums`` every byte is checked too (a full read of the tag).

A tag without a manifest (written by DeepSpeed, or by shardspeed before manifests) is legacy
input and still loads: its readers check that each file they need is there and readable.

Standard library only: this module is part of the standalone ``zero_to_fp32.py``.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from typing import Any, TypedDict

#: the manifest's file name inside a tag folder
MANIFEST = "manifest.json"
#: the manifest's format name and version
MANIFEST_FORMAT = "shardspeed-checkpoint-manifest"
MANIFEST_VERSION = 1
_CHUNK = 16 * 2**20


class FileRecord(TypedDict):
    """One file of a tag: its path relative to the tag folder, size and CRC-32."""

    name: str
    size: int
    crc32: int


def manifest_text(tag: str, records: list[FileRecord]) -> str:
    """The manifest of tag ``tag`` holding ``records`` (sorted by name), as JSON."""
    body: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "tag": tag,
        "files": sorted(records, key=lambda r: r["name"]),
    }
    return json.dumps(body, indent=1) + "\n"


def read_manifest(folder: Path) -> list[FileRecord] | None:
    """The file records of the tag ``folder``'s manifest, or None if it has none."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the checkpoint manifest {path}: {error}") from error
    if body.get("format") != MANIFEST_FORMAT or body.get("version") != MANIFEST_VERSION:
        raise ValueError(
            f"{path} is not a shardspeed checkpoint manifest of version {MANIFEST_VERSION} "
            f"(format {body.get('format')!r}, version {body.get('version')!r}): upgrade shardspeed"
        )
    return list(body["files"])


def file_crc32(path: Path) -> int:
    """The CRC-32 of the bytes of ``path``."""
    crc = 0
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def check_tag(folder: Path, verify_checksums: bool = False) -> bool:
    """Check the tag ``folder`` against its manifest: every listed file present with its size
    (and, with ``verify_checksums``, its CRC-32). Raises ``FileNotFoundError`` or ``ValueError``
    naming the file; returns False for a tag without a manifest (legacy input: its readers check
    the files they need), True otherwise."""
    records = read_manifest(folder)
    if records is None:
        logging.getLogger("shardspeed.checkpoint").debug(
            "no %s in %s: a legacy checkpoint (DeepSpeed's, or an older shardspeed's); its files "
            "are checked as they are read",
            MANIFEST,
            folder,
        )
        return False
    for record in records:
        path = folder / record["name"]
        if not path.is_file():
            raise FileNotFoundError(
                f"checkpoint file {path} is missing: the manifest of {folder} lists it, so the "
                "tag is incomplete (copy the whole tag folder, or load another tag)"
            )
        size = path.stat().st_size
        if size != record["size"]:
            raise ValueError(
                f"checkpoint file {path} is {size} bytes, its manifest says {record['size']}: "
                "it is truncated or was changed after the save (copy it again, or load another "
                "tag)"
            )
        if verify_checksums and file_crc32(path) != record["crc32"]:
            raise ValueError(
                f"checkpoint file {path} does not match the CRC-32 in its manifest: it is "
                "corrupted (copy it again, or load another tag)"
            )
    return True
