"""``OnDevice``: build a model directly on a device (``meta`` for no memory at all) and dtype."""

from __future__ import annotations

from types import TracebackType

import torch


class OnDevice:
    """Context manager: modules created inside it get their parameters and buffers on ``device``
    with floating-point dtype ``dtype``. ``device="meta"`` allocates nothing (shapes only).

    >>> with OnDevice(dtype=torch.float16, device="meta"):
    ...     model = torch.nn.Linear(4, 4)
    """

    def __init__(
        self, dtype: torch.dtype | None, device: str | torch.device = "meta", enabled: bool = True
    ) -> None:
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice(dtype={dtype}) must be a floating-point dtype or None")
        self.dtype = dtype
        self.device = torch.device(device)
        self.enabled = enabled
        self._device_ctx: torch.device | None = None
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if not self.enabled:
            return self
        self._device_ctx = torch.device(self.device)
        self._device_ctx.__enter__()
        if self.dtype is not None:
            self._saved_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        if self._saved_dtype is not None:
            torch.set_default_dtype(self._saved_dtype)
            self._saved_dtype = None
        assert self._device_ctx is not None
        self._device_ctx.__exit__(exc_type, exc, tb)
        self._device_ctx = None
