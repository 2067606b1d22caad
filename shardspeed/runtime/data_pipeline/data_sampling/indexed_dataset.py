"""Index files in Megatron's / DeepSpeed's ``MMapIndexedDataset`` layout (``.idx`` + ``.bin``).

A file holds rows of numbers of one dtype. ``prefix.bin`` is the rows back to back;
``prefix.idx`` is the header ``MMIDIDX\\x00\\x00``, version (``<Q`` 1), dtype code (``<B``),
row count (``<Q``), document count (``<Q``), then the row lengths (int32), the rows' byte
offsets (int64) and the document boundaries (int64: 0..rows, one row per document here). The
data analyzer writes them and the curriculum sampler reads them; files written by DeepSpeed's
analyzer read the same way.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["MMapIndexedDataset", "write_indexed_dataset"]

_MAGIC = b"MMIDIDX\x00\x00"
_DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float64,
    8: np.uint16,
    9: np.uint32,
    10: np.uint64,
}
_CODES = {np.dtype(t): code for code, t in sorted(_DTYPES.items(), reverse=True)}


def write_indexed_dataset(prefix: str | Path, rows: Sequence[np.ndarray], dtype: type) -> None:
    """Write ``rows`` (1-D arrays) to ``prefix.bin`` / ``prefix.idx`` as ``dtype``."""
    kind = np.dtype(dtype)
    if kind not in _CODES:
        raise TypeError(f"index files hold {sorted(map(str, _CODES))}, not {kind}")
    arrays = [np.ascontiguousarray(np.asarray(row).reshape(-1), dtype=kind) for row in rows]
    sizes = np.array([a.size for a in arrays], dtype=np.int32)
    offsets = np.zeros(len(arrays), dtype=np.int64)
    if len(arrays) > 1:
        offsets[1:] = np.cumsum(sizes[:-1].astype(np.int64) * kind.itemsize)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.bin", "wb") as data:
        for array in arrays:
            data.write(array.tobytes(order="C"))
    with open(f"{prefix}.idx", "wb") as index:
        index.write(_MAGIC)
        index.write(struct.pack("<Q", 1))
        index.write(struct.pack("<B", _CODES[kind]))
        index.write(struct.pack("<Q", len(arrays)))
        index.write(struct.pack("<Q", len(arrays) + 1))
        index.write(sizes.tobytes(order="C"))
        index.write(offsets.tobytes(order="C"))
        index.write(np.arange(len(arrays) + 1, dtype=np.int64).tobytes(order="C"))


class MMapIndexedDataset:
    """Read-only rows of an index file (``dataset[i]`` is row ``i`` as a numpy array)."""

    def __init__(self, path: str | Path, skip_warmup: bool = True) -> None:
        del skip_warmup  # DeepSpeed's argument: there is no page warm-up to skip here
        self.path = str(path)
        with open(f"{path}.idx", "rb") as index:
            if index.read(len(_MAGIC)) != _MAGIC:
                raise ValueError(f"{path}.idx is not an MMapIndexedDataset index file")
            (version,) = struct.unpack("<Q", index.read(8))
            if version != 1:
                raise ValueError(f"{path}.idx: index version {version}, expected 1")
            (code,) = struct.unpack("<B", index.read(1))
            (count,) = struct.unpack("<Q", index.read(8))
            index.read(8)  # the document count: rows are read one by one
            header = index.tell()
        self.dtype = np.dtype(_DTYPES[code])
        raw = np.memmap(f"{path}.idx", mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(raw, dtype=np.int32, count=count, offset=header)
        self.pointers = np.frombuffer(
            raw, dtype=np.int64, count=count, offset=header + self.sizes.nbytes
        )
        self._data = np.memmap(f"{path}.bin", mode="r", dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)} in {self.path}")
        i %= len(self)
        if self.sizes[i] == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.frombuffer(
            self._data, dtype=self.dtype, count=int(self.sizes[i]), offset=int(self.pointers[i])
        )
