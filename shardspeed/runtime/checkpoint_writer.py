"""Writing one checkpoint tag from every rank: each rank's files in the foreground or in a
background thread, then a commit every rank agrees on.

:func:`start_save` takes each rank's files (name -> state) and writes them into the tag's staging
folder (:mod:`shardspeed.checkpoint.commit`), each durably with its size and CRC-32
(:func:`~shardspeed.checkpoint.file_writer.save_file`). In the background (``checkpoint.writer
.decoupled``) the state was copied to the CPU first (:func:`~shardspeed.checkpoint.snapshot
.snapshot`), so training may change the live tensors meanwhile; the thread runs no collective.
:meth:`PendingSave.finish`, called by every rank (at once for a synchronous save; from
``engine.wait_for_checkpoint()`` or the next save for a background one), joins the writer,
agrees across ranks on whether every file was written, gathers the file records, and has the
writing rank of each disk write the manifest, rename the tag into place and move ``latest``.
A failure anywhere raises on every rank and leaves ``latest`` where it was.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardspeed import comm
from shardspeed.checkpoint.commit import commit, open_staging
from shardspeed.checkpoint.file_writer import save_file
from shardspeed.checkpoint.files import staging_folder
from shardspeed.checkpoint.manifest import FileRecord
from shardspeed.checkpoint.standalone import write_script
from shardspeed.runtime.rank_agreement import agree_on
from shardspeed.utils.logging import log_dist


@dataclass
class PendingSave:
    """A tag being written by this rank: its files, and whether they are all on disk."""

    save_dir: str
    tag: str
    save_latest: bool
    #: this rank writes the files every rank of its disk shares (model states, manifest, latest)
    commits: bool
    device: torch.device
    records: list[FileRecord] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def write(self, files: dict[str, Any], zip_format: bool) -> None:
        """Write ``files`` (name -> state) into the staging folder; keep the first error."""
        try:
            staging = open_staging(self.save_dir, self.tag)
            for name, state in files.items():
                self.records.append(save_file(state, staging, name, zip_format))
        except BaseException as error:  # noqa: BLE001 - reported to every rank at finish
            self.error = error

    def finish(self) -> None:
        """Join the writer and commit the tag, on every rank (a collective). Raises on every
        rank if any rank failed to write its files or the commit failed."""
        if self.thread is not None:
            self.thread.join()
        where = f"{Path(self.save_dir) / self.tag}"
        failure: BaseException | None = None
        if self.error is not None:
            failure = RuntimeError(
                f"saving checkpoint {where} failed on this rank ({_describe(self.error)}); "
                "nothing of it was committed and 'latest' still names the previous tag"
            )
            failure.__cause__ = self.error
        try:
            agree_on(failure, f"write checkpoint {where}; 'latest' was not moved", self.device)
        except BaseException:
            if self.commits:
                shutil.rmtree(staging_folder(self.save_dir, self.tag), ignore_errors=True)
            raise
        gathered: list[list[FileRecord]] = [[] for _ in range(comm.get_world_size())]
        if comm.get_world_size() > 1:
            comm.all_gather_object(gathered, self.records)
        else:
            gathered = [self.records]
        failure = None
        if self.commits:
            try:
                staging = staging_folder(self.save_dir, self.tag)
                # with node-local storage each disk's manifest lists the files on that disk
                on_disk = [r for rank in gathered for r in rank if (staging / r["name"]).is_file()]
                commit(self.save_dir, self.tag, on_disk, self.save_latest)
                write_script(self.save_dir)
            except Exception as error:  # every rank must learn of it
                failure = error
        agree_on(failure, f"commit checkpoint {where}", self.device)
        log_dist(f"saved checkpoint {where}", ranks=[0])


def _describe(error: BaseException) -> str:
    """``error`` and, when it was raised while handling another (torch.save's cleanup after a
    failed write), the first error of the chain: the one that says what went wrong."""
    first = error
    while (first.__cause__ or first.__context__) is not None:
        first = first.__cause__ or first.__context__  # type: ignore[assignment]
    text = f"{type(error).__name__}: {error}"
    return text if first is error else f"{type(first).__name__}: {first}, then {text}"


def start_save(
    pending: PendingSave, files: dict[str, Any], zip_format: bool, background: bool
) -> PendingSave:
    """Start writing ``files`` for ``pending``: in a background thread, or here and now."""
    if background:
        pending.thread = threading.Thread(
            target=pending.write,
            args=(files, zip_format),
            name=f"shardspeed-checkpoint-{pending.tag}",
            daemon=True,
        )
        pending.thread.start()
    else:
        pending.write(files, zip_format)
    return pending
