"""Making a checkpoint tag appear whole or not at all.

A save writes the tag's files into a hidden staging folder (:func:`~.files.staging_folder`),
each durably (:mod:`.file_writer`). Once every rank's files are written, the writing rank
commits (:func:`commit`): it writes the manifest (:mod:`.manifest`) into the staging folder, renames the
folder to the tag, and only then moves ``latest``. A process killed at any point before the
rename leaves no tag (a stale staging folder, cleared by the next save of that tag) and ``latest``
naming the previous tag; killed after it, a complete tag. Re-saving an existing tag moves the old
folder aside for the instant of the rename (:func:`~.files.existing_tag` finds it if a kill
lands there). No collectives here: the runtime's checkpointer agrees across ranks around it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shardspeed.checkpoint import crash_points, durable
from shardspeed.checkpoint.files import LATEST_FILE, replaced_folder, staging_folder
from shardspeed.checkpoint.manifest import MANIFEST, FileRecord, manifest_text


def clear_staging(save_dir: str, tag: str) -> None:
    """Remove what an interrupted earlier save of ``tag`` left in its staging folder."""
    shutil.rmtree(staging_folder(save_dir, tag), ignore_errors=True)


def open_staging(save_dir: str, tag: str) -> Path:
    """The staging folder of ``tag``, created if needed (every rank may create it)."""
    staging = staging_folder(save_dir, tag)
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def commit(save_dir: str, tag: str, records: list[FileRecord], save_latest: bool) -> Path:
    """Write the manifest of ``records`` into the staging folder of ``tag``, rename the folder to
    the tag, then (``save_latest``) name it in ``latest``; returns the tag folder."""
    staging, final = staging_folder(save_dir, tag), Path(save_dir) / tag
    crash_points.reached("manifest")
    durable.write_text(staging / MANIFEST, manifest_text(tag, records))
    crash_points.reached("commit")
    previous = replaced_folder(save_dir, tag)
    if final.exists():
        shutil.rmtree(previous, ignore_errors=True)
        durable.replace(final, previous)
        crash_points.reached("replace")
    durable.replace(staging, final)
    crash_points.reached("latest")
    if save_latest:
        durable.write_text(Path(save_dir) / LATEST_FILE, tag)
    shutil.rmtree(previous, ignore_errors=True)
    crash_points.reached("done")
    return final
