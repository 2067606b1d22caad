"""Moving activations and gradients between neighbouring pipeline stages over
:mod:`shardspeed.comm` point-to-point calls.

A message is one tensor or a tuple of tensors. The first time a stage sends to a neighbour in a
mode (training or evaluation), it sends a description of the message (its length first, then
per tensor: dtype, requires_grad, shape) so the receiver can allocate; both sides cache it and
later messages are the tensors only. With ``dynamic_shape`` the description goes with every
message; :meth:`P2PChannel.reset` forgets the cache (``reset_activation_shape``), on both sides.
The engine resets the cache on every rank when the first stage's inputs change shape between
batches, and describes every message of a batch whose micro-batches differ, so ``dynamic_shape``
is only needed where a stage's outputs change shape while its inputs do not. A sender whose
message no longer matches the cached description refuses to send (the receiver would read
wrong sizes). Gradients need no description: they have the shapes of the
activations that required grad, in the same order.

A stage that failed earlier in the batch still sends what its neighbour waits for
(:meth:`P2PChannel.send_missing`): zeros of the cached description, or, with no description to
follow, the "absent" marker, a description of length 0; a receiver of the marker gets None,
passes the absence on and sends no gradient back.

Sends are asynchronous (``isend``): a stage goes on computing while its neighbour has not yet
reached the matching receive (gloo and NCCL hold a large send until then). The channel keeps
each message alive until its send completes; :meth:`P2PChannel.wait_sends` waits for all of
them (the engine calls it at the end of every schedule). Receives are posted one message
ahead: once a message from a neighbour has arrived and more are expected from it in this
schedule (:meth:`P2PChannel.expect`), the next one's ``irecv`` is posted with the cached
description (shapes are fixed within a schedule unless they are described every time), so its
transfer overlaps this stage's compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed import comm

#: dtypes a message may carry, by their code in the description
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    requires_grad: bool
    shape: tuple[int, ...]


@dataclass(frozen=True)
class MessageMeta:
    """What a message holds: whether it is a tuple, and each tensor's description."""

    is_tuple: bool
    tensors: tuple[TensorMeta, ...]

    @classmethod
    def of(cls, message: Any) -> MessageMeta:
        tensors = message if isinstance(message, tuple) else (message,)
        metas = []
        for index, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"a pipeline stage's output must be a tensor or a tuple of tensors; "
                    f"element {index} is {type(tensor).__name__}"
                )
            if tensor.dtype not in _CODE:
                raise TypeError(f"pipeline activations of dtype {tensor.dtype} are not supported")
            metas.append(TensorMeta(tensor.dtype, tensor.requires_grad, tuple(tensor.shape)))
        return cls(isinstance(message, tuple), tuple(metas))

    def encode(self) -> list[int]:
        out = [int(self.is_tuple), len(self.tensors)]
        for meta in self.tensors:
            out += [_CODE[meta.dtype], int(meta.requires_grad), len(meta.shape), *meta.shape]
        return out

    @classmethod
    def decode(cls, values: Sequence[int]) -> MessageMeta:
        is_tuple, count = bool(values[0]), values[1]
        pos, metas = 2, []
        for _ in range(count):
            dtype, grad, ndim = _DTYPES[values[pos]], bool(values[pos + 1]), values[pos + 2]
            shape = tuple(values[pos + 3 : pos + 3 + ndim])
            metas.append(TensorMeta(dtype, grad, shape))
            pos += 3 + ndim
        return cls(is_tuple, tuple(metas))

    @property
    def grad_metas(self) -> list[TensorMeta]:
        return [m for m in self.tensors if m.requires_grad]

    def placeholder(self, device: torch.device, training: bool) -> Any:
        """Zeros of this description (leaves that require grad where it says so): what a stage
        sends in place of a message it cannot send, so its neighbour does not wait forever."""
        tensors = tuple(
            torch.zeros(m.shape, dtype=m.dtype, device=device).requires_grad_(
                m.requires_grad and training
            )
            for m in self.tensors
        )
        return tensors if self.is_tuple else tensors[0]


class ActivationShapeError(RuntimeError):
    """A stage's output changed shape or dtype while shapes are cached."""


class P2PChannel:
    """This stage's activation and gradient exchange with its neighbours (global ranks)."""

    def __init__(self, device: torch.device, dynamic_shape: bool = False) -> None:
        self.device = device
        self.dynamic_shape = dynamic_shape
        #: describe every message for now (set by the engine for a batch whose micro-batches
        #: differ in shape)
        self.describe_always = False
        #: (peer, training) -> the description last exchanged
        self._sent: dict[tuple[int, bool], MessageMeta] = {}
        self._received: dict[tuple[int, bool], MessageMeta] = {}
        #: (work handle, tensor) of sends not known to be complete
        self._pending: list[tuple[Any, torch.Tensor]] = []
        #: (peer, kind) -> messages still expected from it in this schedule
        self._expected: dict[tuple[int, str], int] = {}
        #: (peer, kind) -> the next message's receives, posted early: [(handle, tensor)]
        self._posted: dict[tuple[int, str], list[tuple[Any, torch.Tensor]]] = {}

    def expect(self, peer: int, kind: str, count: int) -> None:
        """``count`` messages of ``kind`` ("act" or "grad") will come from ``peer`` in this
        schedule (nothing more: receives are posted ahead only within that count)."""
        assert not self._posted.get((peer, kind)), "a receive is still posted from the last one"
        self._expected[(peer, kind)] = count

    def _prefetching(self) -> bool:
        return not (self.dynamic_shape or self.describe_always)

    def _take(
        self, peer: int, kind: str, templates: Sequence[tuple[tuple[int, ...], torch.dtype]]
    ) -> list[torch.Tensor]:
        """The next message of ``kind`` from ``peer``: the posted receives, waited for, or
        received now; then the following one is posted if more are expected."""
        key = (peer, kind)
        posted = self._posted.pop(key, None)
        if posted is not None:
            for work, _ in posted:
                work.wait()
            tensors = [tensor for _, tensor in posted]
        else:
            tensors = []
            for shape, dtype in templates:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                comm.recv(tensor, peer)
                tensors.append(tensor)
        left = self._expected.get(key, 0) - 1
        self._expected[key] = left
        if left > 0 and self._prefetching():
            ahead = []
            for shape, dtype in templates:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                ahead.append((comm.irecv(tensor, peer), tensor))
            self._posted[key] = ahead
        return tensors

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.detach().contiguous()
        self._pending.append((comm.isend(tensor, dst), tensor))
        if len(self._pending) > 8:  # forget the completed ones now and then
            self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def wait_sends(self) -> None:
        """Wait until every send has been received."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def reset(self) -> None:
        """Forget every cached description (both neighbours must reset too)."""
        self._sent.clear()
        self._received.clear()

    # -- activations -------------------------------------------------------------------------
    def send_activations(self, message: Any, dst: int, training: bool) -> tuple[Any, str | None]:
        """Send ``message`` to ``dst``; returns what was sent and None, or, when the message
        no longer matches the cached description, zeros of the cached one and the error (the
        neighbour receives what it expects and the batch ends with the error on every rank,
        instead of the neighbour waiting forever)."""
        meta = MessageMeta.of(message)
        key = (dst, training)
        cached = self._sent.get(key)
        error = None
        if cached is None or self.dynamic_shape or self.describe_always:
            encoded = torch.tensor(meta.encode(), dtype=torch.int64, device=self.device)
            self._send(torch.tensor([encoded.numel()], device=self.device), dst)
            self._send(encoded, dst)
            self._sent[key] = meta
        elif cached != meta:
            error = (
                f"{ActivationShapeError.__name__}: this stage's output changed from {cached} to "
                f"{meta} while its input did not, but the activation shapes are cached; build "
                "the PipelineModule with dynamic_shape=True, or call "
                "engine.reset_activation_shape() on every rank before the change"
            )
            message = cached.placeholder(self.device, training)
        tensors = message if isinstance(message, tuple) else (message,)
        for tensor in tensors:
            self._send(tensor.detach() if error else tensor, dst)
        return message, error

    def send_missing(self, dst: int, training: bool) -> Any:
        """Stand in for a message this stage could not compute (it failed earlier in the
        batch), so ``dst`` does not wait forever: zeros of the cached description, which are
        returned (their gradients come back), or, with no description to follow, the "absent"
        marker (a description of length 0; the receiver gets None and no gradient returns)."""
        cached = self._sent.get((dst, training))
        if cached is None or self.dynamic_shape or self.describe_always:
            self._send(torch.zeros(1, dtype=torch.int64, device=self.device), dst)
            return None
        placeholder = cached.placeholder(self.device, training)
        for tensor in placeholder if isinstance(placeholder, tuple) else (placeholder,):
            self._send(tensor.detach(), dst)
        return placeholder

    def recv_activations(self, src: int, training: bool) -> tuple[Any, MessageMeta | None]:
        """The message from ``src`` (tensors that required grad there require grad here, as
        leaves whose ``.grad`` goes back) and its description; ``(None, None)`` when ``src``
        sent the "absent" marker (:meth:`send_missing`)."""
        key = (src, training)
        meta = self._received.get(key)
        if meta is None or self.dynamic_shape or self.describe_always:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
            comm.recv(length, src)
            if int(length.item()) == 0:
                return None, None
            encoded = torch.zeros(int(length.item()), dtype=torch.int64, device=self.device)
            comm.recv(encoded, src)
            meta = MessageMeta.decode(encoded.tolist())
            self._received[key] = meta
        received = self._take(src, "act", [(m.shape, m.dtype) for m in meta.tensors])
        tensors = []
        for tensor, tensor_meta in zip(received, meta.tensors, strict=True):
            if tensor_meta.requires_grad and training:
                tensor.requires_grad_()
            tensors.append(tensor)
        return (tuple(tensors) if meta.is_tuple else tensors[0]), meta

    # -- gradients ---------------------------------------------------------------------------
    def send_grads(self, grads: Sequence[torch.Tensor | None], meta: MessageMeta, dst: int) -> None:
        """The gradients of the inputs that required grad (None: zeros), to the stage that
        sent them."""
        for grad, tensor_meta in zip(grads, meta.grad_metas, strict=True):
            if grad is None:
                grad = torch.zeros(tensor_meta.shape, dtype=tensor_meta.dtype, device=self.device)
            self._send(grad, dst)

    def recv_grads(self, outputs: Any, src: int) -> list[torch.Tensor]:
        """The gradients of this stage's ``outputs`` that require grad, from the next stage."""
        tensors = outputs if isinstance(outputs, tuple) else (outputs,)
        templates = [(tuple(t.shape), t.dtype) for t in tensors if t.requires_grad]
        return self._take(src, "grad", templates)
