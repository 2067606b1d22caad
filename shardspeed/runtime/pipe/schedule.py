"""Pipeline schedules as data: each schedule yields, step by step, the list of instructions one
stage executes; :class:`~shardspeed.runtime.pipe.engine.PipelineEngine` is the one executor.

Instructions are plain records (their keyword arguments become attributes, compared by value),
so a schedule can be printed, compared with a documented order and tested without ranks.

The training schedule is synchronous 1F1B (DeepSpeed's ``TrainSchedule``). Steps are numbered
``t = 0 .. 2(m + p - 1) - 1`` for ``m`` micro-batches on ``p`` stages. Stage ``s`` computes a
forward at step ``t`` when ``t - s`` is even, of micro-batch ``(t - s) / 2``, and a backward
when it is odd, of micro-batch ``(t + s + 1 - 2p) / 2``; an index outside ``0 .. m-1`` is an
idle (bubble) step. Neighbouring stages have opposite parity, so every send of one step meets
its receive on the neighbour in the same step, in the same order: each step is atomic and a
barrier between steps cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = [
    "BackwardPass",
    "BufferOpInstruction",
    "DataParallelSchedule",
    "ForwardPass",
    "InferenceSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
]


class PipeInstruction:
    """One thing a stage does; its keyword arguments are its fields (namedtuple-like)."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        fields = ", ".join(f"{key}={value!r}" for key, value in self.kwargs.items())
        return f"{self.name}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after :class:`ReduceGrads` and
    :class:`ReduceTiedGrads`; may synchronise the data-parallel group)."""


class ReduceGrads(PipeInstruction):
    """Reduce the stage's gradients over its data-parallel group."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of tied modules over the stages that hold them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction that works on pipeline buffer ``buffer_id``."""

    buffer_id: int

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """``buffers['inputs'][buffer_id] = next(data_iter)`` (first and last stage)."""


class ForwardPass(BufferOpInstruction):
    """``buffers['outputs'][buffer_id] = forward(buffers['inputs'][buffer_id])``."""


class BackwardPass(BufferOpInstruction):
    """Backpropagate the buffer's outputs with the gradients received for them (the loss on
    the last stage)."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage (blocking, paired with its receive)."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's outputs as this buffer's inputs (blocking)."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of the buffer's inputs to the previous stage (only inputs that
    require grad have one)."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the buffer's outputs from the next stage (blocking)."""


class PipeSchedule:
    """Yields, for one stage, the instruction list of each step of one batch."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(
                f"{type(self).__name__}(micro_batches={micro_batches}, stages={stages}, "
                f"stage_id={stage_id}): need micro_batches >= 1 and 0 <= stage_id < stages"
            )
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """One list of instructions per step."""
        raise NotImplementedError

    def num_pipe_buffers(self) -> int:
        """How many micro-batches' buffers this stage needs at once."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        assert self._valid_micro_batch(micro_batch_id)
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()


class InferenceSchedule(PipeSchedule):
    """Forward passes only: micro-batch ``i`` runs on stage ``s`` at step ``i + s``, with two
    buffers alternating so a stage receives the next inputs while it sends the last outputs."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total_steps = self.micro_batches + self.stages - 1
        for step_id in range(total_steps):
            cmds: list[PipeInstruction] = []
            micro_batch_id = step_id - self.stage_id
            # even stages receive before they send and odd stages the other way round, so each
            # neighbouring pair posts its matching calls in the same order
            recv_buf = (step_id + self.stage_id % 2) % 2
            send_buf = (step_id + 1 + self.stage_id % 2) % 2
            if self.is_first_stage or self.is_last_stage:
                if self._valid_micro_batch(micro_batch_id):
                    cmds.append(LoadMicroBatch(recv_buf))
            receive = self._valid_stage(self.prev_stage) and self._valid_micro_batch(micro_batch_id)
            send = self._valid_stage(self.next_stage) and self._valid_micro_batch(
                micro_batch_id - 1
            )
            if self.stage_id % 2 == 0:
                if send:
                    cmds.append(SendActivation(send_buf))
                if receive:
                    cmds.append(RecvActivation(recv_buf))
            else:
                if receive:
                    cmds.append(RecvActivation(recv_buf))
                if send:
                    cmds.append(SendActivation(send_buf))
            if self._valid_micro_batch(micro_batch_id):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B: after a warm-up of at most ``stages - stage_id`` forwards, each stage
    alternates one forward and one backward, so at most :meth:`num_pipe_buffers` micro-batches'
    activations are alive on it (GPipe keeps all ``micro_batches``). The batch ends with the
    tied and data-parallel gradient reductions and the optimizer step."""

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        """(micro-batch, is_forward) of ``step_id`` on this stage; see the module docstring."""
        if (step_id - self.stage_id) % 2 == 0:
            return (step_id - self.stage_id) // 2, True
        return (step_id + self.stage_id + 1 - 2 * self.stages) // 2, False

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total_steps = 2 * (self.micro_batches + self.stages - 1)
        prev_micro_batch_id = -1
        for step_id in range(total_steps):
            micro_batch_id, is_forward = self._step_to_micro_batch(step_id)
            prev_valid = self._valid_micro_batch(prev_micro_batch_id)
            curr_valid = self._valid_micro_batch(micro_batch_id)
            prev_buffer = self._buffer_idx(prev_micro_batch_id) if prev_valid else -1
            curr_buffer = self._buffer_idx(micro_batch_id) if curr_valid else -1
            cmds: list[PipeInstruction] = []
            # the exchange with the neighbours: what the previous step produced goes out, what
            # this step consumes comes in
            if is_forward:
                if prev_valid and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(prev_buffer))
                if curr_valid and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(curr_buffer))
            else:
                if curr_valid and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(curr_buffer))
                if prev_valid and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(prev_buffer))
            if (self.is_first_stage or self.is_last_stage) and is_forward and curr_valid:
                cmds.append(LoadMicroBatch(curr_buffer))
            if curr_valid:
                cmds.append(ForwardPass(curr_buffer) if is_forward else BackwardPass(curr_buffer))
            if step_id == total_steps - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_micro_batch_id = micro_batch_id
            yield cmds

    def num_pipe_buffers(self) -> int:
        """The forwards in flight on this stage: its distance to the last stage, at most the
        micro-batches, at least 2 (so a step can send one buffer while filling another)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class DataParallelSchedule(PipeSchedule):
    """No pipeline (one stage): forward and backward per micro-batch, then reduce and step."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if step_id == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1
