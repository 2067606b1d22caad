"""``PipelineEngine``: runs pipeline schedules (:mod:`.schedule`) over a
:class:`~.module.PipelineModule`, one stage per rank.

It is the training engine's parts (ZeRO strategy, optimizer wrapper with loss scaling and
clipping, LR scheduler, step counters, checkpoint verbs) plus one executor: every instruction
of a schedule maps to one method here (``_INSTRUCTION_MAP``). ``train_batch`` runs a
:class:`~.schedule.TrainSchedule` over ``gradient_accumulation_steps`` micro-batches;
``eval_batch`` an :class:`~.schedule.InferenceSchedule`. The user-level verbs ``forward``,
``backward`` and ``step`` raise :class:`~.module.PipelineError`: the schedule interleaves them.

Gradients: every micro-batch's backward accumulates locally (the strategy's hooks, no
reduction); at the end of the batch the tied weights' gradients are summed over their stages
(:class:`ReduceTiedGrads`), then the strategy reduces over the stage's data-parallel group
(:class:`ReduceGrads`), then the optimizer steps with the global norm taken over every stage
(:class:`~shardspeed.runtime.zero.model_parallel_norm.ModelParallelNormReducer`).

Errors do not stop a rank where its neighbours would wait for it forever (:mod:`.failure`): a
data iterator is read for the whole batch before the schedule starts, and every rank learns
whether reading failed on any stage; an exception in a forward or backward pass (or a last
stage whose output is not a loss) is recorded, the stage finishes the schedule sending zeros or
"absent" markers, and every rank raises together before the optimizer step.

Data: with ``training_data`` the first and last stages read DeepSpeed's pipeline loader, each
data-parallel rank's shard in order (no shuffle) and repeating (``RepeatingLoader``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch.utils.data.distributed import DistributedSampler

from shardspeed import comm
from shardspeed.runtime.activation_checkpointing import checkpointing
from shardspeed.runtime.checkpoint_format import CheckpointFormat
from shardspeed.runtime.engine import DeepSpeedEngine
from shardspeed.runtime.engine_parts import EngineParts
from shardspeed.runtime.pipe import schedule
from shardspeed.runtime.pipe.checkpoint import PIPELINE_FORMAT
from shardspeed.runtime.pipe.failure import StageFailure
from shardspeed.runtime.pipe.module import PipelineError, PipelineModule
from shardspeed.runtime.pipe.p2p import MessageMeta, P2PChannel
from shardspeed.runtime.precision.autocast import autocast_if_enabled
from shardspeed.runtime.zero.records import record_of
from shardspeed.utils.loaders import RepeatingLoader

__all__ = ["PipelineEngine", "PipelineError"]


def _to_device(item: Any, device: torch.device) -> Any:
    if isinstance(item, torch.Tensor):
        return item.to(device, non_blocking=True)
    if isinstance(item, tuple | list):
        return type(item)(_to_device(x, device) for x in item)
    return item


def _tensors(message: Any) -> tuple[torch.Tensor, ...]:
    return message if isinstance(message, tuple) else (message,)


def _requiring_grad(inputs: Any) -> Any:
    """Copies of the floating-point tensors among ``inputs`` that require grad (the caller's
    tensors are left alone)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.detach().clone().requires_grad_(inputs.is_floating_point())
    if isinstance(inputs, tuple):
        return tuple(_requiring_grad(x) for x in inputs)
    return inputs


def _inputs_of(batch: Any) -> Any:
    """The inputs of an ``(inputs, labels)`` micro-batch, as the first stage receives them."""
    if isinstance(batch, tuple | list) and len(batch) == 2:
        inputs = batch[0]
        return tuple(inputs) if isinstance(inputs, list) else inputs
    return ()


#: instructions that run user code (layers, the loss, autograd): a failure there is recorded
#: and the schedule goes on, so the neighbours are not left waiting
_COMPUTE = (schedule.LoadMicroBatch, schedule.ForwardPass, schedule.BackwardPass)


class ActivationMeter:
    """Counts the micro-batches whose activations are alive on this stage (weak references to
    each forward's outputs: alive while autograd or a buffer still holds them)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self.peak = 0

    def record(self, outputs: Any) -> None:
        tensors = [t for t in _tensors(outputs) if isinstance(t, torch.Tensor)]
        if tensors:
            self._refs.append(weakref.ref(tensors[0]))
        self._refs = [r for r in self._refs if r() is not None]
        self.peak = max(self.peak, len(self._refs))

    def alive(self) -> int:
        self._refs = [r for r in self._refs if r() is not None]
        return len(self._refs)


class PipelineEngine(DeepSpeedEngine):
    """The engine :func:`shardspeed.initialize` returns for a :class:`PipelineModule`."""

    #: DeepSpeed's pipeline layout: a file per layer, per stage and per shard
    checkpoint_format: ClassVar[CheckpointFormat] = PIPELINE_FORMAT

    def __init__(self, parts: EngineParts) -> None:
        super().__init__(parts)
        module = self.module
        assert isinstance(module, PipelineModule), "model must be a PipelineModule"
        self.pipe_module: PipelineModule = module
        self.grid = module.mpu()
        self._grid = self.grid
        self.num_stages = self.grid.pipe_parallel_size
        self.stage_id = self.grid.get_stage_id()
        self.prev_stage = self.stage_id - 1
        self.next_stage = self.stage_id + 1
        last = self.grid.pipe_parallel_size - 1
        self._prev_rank = self.grid.stage_to_global(max(self.prev_stage, 0))
        self._next_rank = self.grid.stage_to_global(min(self.next_stage, last))
        self.micro_batches = self.gradient_accumulation_steps()
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = self.grid.data_parallel_size > 1
        self.channel = P2PChannel(self.device, module.dynamic_shape)
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.activation_meter = ActivationMeter()
        #: host seconds spent in each instruction kind since the engine was built (a receive
        #: includes waiting for the sender); the benchmark reads the bubble from it
        self.instruction_seconds: dict[str, float] = {}
        self.agg_train_loss: torch.Tensor | None = None
        self.first_output_send = True
        self._failure = StageFailure(self.stage_id, self.device)
        self._batch: list[Any] = []
        #: shapes and dtypes of the last batch's inputs (first stage), to notice a change
        self._input_shapes: Any = None
        self._reset_buffers(0)
        if self.training_dataloader is not None:
            self._build_data_iter(self.training_dataloader.dataloader.dataset)

    def _build_data_iter(self, dataset: Any) -> None:
        """DeepSpeed's pipeline loader: this data-parallel rank's shard in order (a pipeline
        does not shuffle), restarting when exhausted."""
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=self.grid.get_data_parallel_world_size(),
            rank=self.grid.get_data_parallel_rank(),
            shuffle=False,
        )
        self.set_dataloader(RepeatingLoader(self.deepspeed_io(dataset, data_sampler=sampler)))

    # -- the verbs a pipeline does not have ---------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def coalesce_grad_reduction(self) -> Any:  # type: ignore[override]
        raise NotImplementedError(
            "coalesce_grad_reduction() is not available under pipeline parallelism: "
            "train_batch() already reduces gradients once per batch"
        )

    # -- queries and setters ----------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataloader(self, loader: Any) -> None:
        """Read micro-batches from ``loader`` from now on (first and last stage only)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator[Any] | None) -> None:
        """Read micro-batches from ``iterator`` (first and last stage only; it replaces the
        training loader there, as in DeepSpeed)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the stage's forward checkpoints activations with the reentrant function;
        the first stage's floating-point inputs then require grad, as DeepSpeed marks them
        (shardspeed's reentrant checkpoint would not need it: it anchors the block itself)."""
        module = self.pipe_module
        return (
            module.activation_checkpoint_interval > 0
            and module.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint
        )

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Apply ``fn`` to every micro-batch read, before it is split into inputs and labels."""
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """Forget the cached activation shapes; the next transfer describes its tensors again
        (every rank must call it)."""
        self.channel.reset()
        self.first_output_send = True

    def set_train_batch_size(self, train_batch_size: int) -> None:
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()

    # -- the batch verbs --------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from
        ``data_iter``; returns the batch's mean loss on every stage."""
        if not torch.is_grad_enabled():
            raise PipelineError(
                "train_batch() requires gradients enabled. Use eval_batch() instead."
            )
        self._optim.require("train_batch()")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.micro_batches = self.gradient_accumulation_steps()
        self._fetch_batch(self.micro_batches)
        sched = schedule.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id)
        self._losses: list[torch.Tensor] = []
        self._exec_schedule(sched, training=True)
        self.agg_train_loss = self._aggregate_loss(self._losses, bcast=True)
        self._write_monitor_events(self.agg_train_loss)
        if self.autotuning_probe is not None:  # after the batch's last collective: may exit
            self.autotuning_probe.after_step(self.global_steps)
        return self.agg_train_loss

    def _write_monitor_events(self, loss: torch.Tensor) -> None:
        """The batch's loss, learning rate and loss scale to the configured monitors."""
        monitor = self.observability.monitor
        if not monitor.enabled:
            return
        x = self.global_samples
        events = [("Train/Samples/train_loss", float(loss), x)]
        lrs = self.get_lr()
        if lrs:
            events.append(("Train/Samples/lr", float(lrs[0]), x))
        if self.precision.needs_loss_scaling:
            events.append(("Train/Samples/loss_scale", float(self.loss_scale), x))
        monitor.write_events(events)

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward passes over ``num_micro_batches`` (default ``gradient_accumulation_steps``)
        micro-batches. Returns the mean loss (``reduce_output="avg"``; averaged over the
        data-parallel group, on every stage with ``bcast_loss``) or the per-micro-batch losses
        (``reduce_output=None``); with ``return_logits``, ``(loss, logits)`` where logits are
        the last stage's outputs of the last micro-batch (None on other stages)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output={reduce_output!r}: use 'avg' or None")
        # DeepSpeed evaluates from data_iter and then trains on from where it was
        train_loader, train_iterator = self.training_dataloader, self.data_iterator
        self.set_dataiterator(data_iter)
        was_training = self.module.training
        self.module.eval()
        micro_batches = num_micro_batches or self.gradient_accumulation_steps()
        self._fetch_batch(micro_batches)
        self._losses = []
        self._compute_loss = compute_loss
        self._last_outputs: Any = None
        sched = schedule.InferenceSchedule(micro_batches, self.num_stages, self.stage_id)
        try:
            with torch.no_grad():
                self._exec_schedule(sched, training=False)
        finally:
            self._compute_loss = True
            self.module.train(was_training)
            if self.is_first_stage() or self.is_last_stage():
                self.training_dataloader, self.data_iterator = train_loader, train_iterator
        self._failure.agree("eval_batch")
        output: Any = None
        if compute_loss:
            if reduce_output == "avg":
                output = self._aggregate_loss(self._losses, bcast=bcast_loss)
            else:
                output = self._losses if self.is_last_stage() else None
        logits, self._last_outputs = self._last_outputs, None
        return (output, logits) if return_logits else output

    # -- data ---------------------------------------------------------------------------------
    def _fetch_batch(self, count: int) -> None:
        """Read the batch's ``count`` micro-batches now (first and last stage), so a data
        iterator that runs dry is found on every rank before any transfer starts."""
        self._batch = []
        self._failure.clear()
        if self.is_first_stage() or self.is_last_stage():
            self._read_batch(count)
        shape_change = self._input_shape_change() if not self._failure.failed else 0
        shape_change = self._failure.agree("reading the batch", shape_change)
        # the first stage's inputs decide every activation's shape: when they change, every
        # rank describes its messages again (and for each message while they vary in a batch)
        if shape_change:
            self.channel.reset()
        self.channel.describe_always = shape_change == 2
        self._batch.reverse()

    def _read_batch(self, count: int) -> None:
        """Read ``count`` micro-batches into ``self._batch``; a failure of any kind (the
        iterator, ``batch_fn``, a micro-batch that is not a pair) is recorded, not raised,
        so the other stages learn of it instead of waiting in the agreement."""
        if self.data_iterator is None:
            self._failure.record(
                "no data iterator: pass train_batch(data_iter=...) / eval_batch(data_iter) "
                "or training_data= to initialize()"
            )
            return
        try:
            for index in range(count):
                batch = next(self.data_iterator)
                if self.batch_fn is not None:
                    batch = self.batch_fn(batch)
                if not isinstance(batch, tuple | list) or len(batch) != 2:
                    raise PipelineError(
                        f"micro-batch {index}: a pipeline micro-batch must be a pair (inputs, "
                        f"labels); got {type(batch).__name__}"
                    )
                self._batch.append(batch)
        except StopIteration:
            self._failure.record(
                f"the data iterator ran dry after {len(self._batch)} of the batch's {count} "
                "micro-batches (gradient_accumulation_steps); wrap the loader in "
                "shardspeed.utils.RepeatingLoader or give it enough batches"
            )
        except Exception as exc:  # noqa: BLE001 - every stage must hear of any failure
            self._failure.record_exception(exc, f"reading micro-batch {len(self._batch)}")

    def _input_shape_change(self) -> int:
        """On the first stage: 0 if the batch's inputs have the shapes of the last batch's, 1
        if they changed, 2 if they differ between its micro-batches (elsewhere 0)."""
        if not self.is_first_stage() or self.pipe_module.dynamic_shape:
            return 0
        shapes = {
            tuple((tuple(t.shape), t.dtype) for t in _tensors(_inputs_of(batch)))
            for batch in self._batch
        }
        if len(shapes) > 1:
            return 2
        previous, self._input_shapes = self._input_shapes, next(iter(shapes), None)
        return int(previous is not None and previous != self._input_shapes)

    # -- the executor -----------------------------------------------------------------------
    def _reset_buffers(self, count: int) -> None:
        self.pipe_buffers: dict[str, list[Any]] = {
            key: [None] * count
            for key in ("inputs", "labels", "outputs", "meta", "output_grads", "loss")
        }

    def _exec_schedule(self, sched: schedule.PipeSchedule, training: bool) -> None:
        self._training = training
        self._reset_buffers(sched.num_pipe_buffers())
        if not self.is_first_stage():
            self.channel.expect(self._prev_rank, "act", sched.num_micro_batches)
        if training and not self.is_last_stage():
            self.channel.expect(self._next_rank, "grad", sched.num_micro_batches)
        times = self.instruction_seconds
        for step_cmds in sched:
            for cmd in step_cmds:
                handler = self._INSTRUCTION_MAP.get(type(cmd))
                if handler is None:
                    raise RuntimeError(
                        f"PipelineEngine has no handler for instruction {type(cmd).__name__}"
                    )
                start = time.perf_counter()
                try:
                    handler(self, cmd)
                except Exception as exc:
                    if not isinstance(cmd, _COMPUTE):
                        raise
                    # the neighbours wait on this stage: keep to the schedule, raise later
                    self._failure.record_exception(exc, f"{cmd!r}")
                    for key in ("outputs", "loss"):
                        self.pipe_buffers[key][cmd.buffer_id] = None
                times[cmd.name] = times.get(cmd.name, 0.0) + time.perf_counter() - start
        self.channel.wait_sends()
        self._reset_buffers(0)

    def _exec_load_micro_batch(self, cmd: schedule.LoadMicroBatch) -> None:
        inputs, labels = self._batch.pop()
        if self.is_first_stage():
            inputs = _to_device(tuple(inputs) if isinstance(inputs, list) else inputs, self.device)
            if self._training and self._reentrant_activation_checkpointing():
                inputs = _requiring_grad(inputs)
            self.pipe_buffers["inputs"][cmd.buffer_id] = inputs
        if self.is_last_stage():
            self.pipe_buffers["labels"][cmd.buffer_id] = _to_device(labels, self.device)

    def _exec_forward_pass(self, cmd: schedule.ForwardPass) -> None:
        buffer = cmd.buffer_id
        inputs = self.pipe_buffers["inputs"][buffer]
        if inputs is None or self._failure.failed:
            return  # a stage failed this batch: nothing to compute, the sends stand in
        policy = self.precision
        with autocast_if_enabled(
            policy.autocast_enabled,
            policy.autocast_dtype,
            self.device.type,
            native_low_precision=policy.param_dtype != torch.float32,
        ):
            outputs = self.module(inputs)
        if self._training:
            self.activation_meter.record(outputs)
        if not self.is_last_stage():
            self.pipe_buffers["outputs"][buffer] = outputs
            return
        if not self._training:
            self._last_outputs = outputs
            if not self._compute_loss:
                return
        loss = self._loss(outputs, self.pipe_buffers["labels"][buffer])
        self.pipe_buffers["loss"][buffer] = loss
        if loss is not None:
            self._losses.append(loss.detach().float().reshape(()))

    def _loss(self, outputs: Any, labels: Any) -> torch.Tensor | None:
        loss_fn = self.pipe_module.loss_fn
        loss = loss_fn(outputs, labels) if loss_fn is not None else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            return loss
        self._failure.record(
            "the last stage's output is not a scalar loss and the PipelineModule has no "
            "loss_fn; pass loss_fn=<fn(outputs, labels) -> loss> to PipelineModule"
        )
        return None

    def _exec_backward_pass(self, cmd: schedule.BackwardPass) -> None:
        buffer = self.pipe_buffers
        loss, outputs = buffer["loss"][cmd.buffer_id], buffer["outputs"][cmd.buffer_id]
        grads = buffer["output_grads"][cmd.buffer_id]
        for key in ("outputs", "output_grads", "loss", "labels"):
            buffer[key][cmd.buffer_id] = None
        if self._failure.failed or (loss if self.is_last_stage() else outputs) is None:
            return  # the batch will be dropped: the input gradients sent back are zeros
        self.strategy.begin_backward(reduce=False)
        try:
            if self.is_last_stage():
                self._optim.scale_loss(loss / self.micro_batches).backward()
            else:
                requiring = [t for t in _tensors(outputs) if t.requires_grad]
                if requiring:
                    torch.autograd.backward(tensors=requiring, grad_tensors=grads)
        finally:
            self.strategy.end_backward()

    def _exec_send_activations(self, cmd: schedule.SendActivation) -> None:
        outputs = self.pipe_buffers["outputs"][cmd.buffer_id]
        if outputs is None:  # this stage failed or received nothing: stand in for the message
            sent = self.channel.send_missing(self._next_rank, self._training)
            self.pipe_buffers["outputs"][cmd.buffer_id] = sent
        else:
            sent, error = self.channel.send_activations(outputs, self._next_rank, self._training)
            if error is not None:  # zeros went instead: finish the batch, then stop everywhere
                self._failure.record(error)
                self.pipe_buffers["outputs"][cmd.buffer_id] = sent
        self.first_output_send = False
        if not self._training:
            self.pipe_buffers["outputs"][cmd.buffer_id] = None

    def _exec_recv_activations(self, cmd: schedule.RecvActivation) -> None:
        inputs, meta = self.channel.recv_activations(self._prev_rank, self._training)
        self.pipe_buffers["inputs"][cmd.buffer_id] = inputs
        self.pipe_buffers["meta"][cmd.buffer_id] = meta

    def _exec_send_grads(self, cmd: schedule.SendGrad) -> None:
        inputs = self.pipe_buffers["inputs"][cmd.buffer_id]
        meta: MessageMeta | None = self.pipe_buffers["meta"][cmd.buffer_id]
        if meta is not None:  # None: the message was absent, so no gradient is expected
            grads = [t.grad for t in _tensors(inputs) if t.requires_grad]
            self.channel.send_grads(grads, meta, self._prev_rank)
        self.pipe_buffers["inputs"][cmd.buffer_id] = None
        self.pipe_buffers["meta"][cmd.buffer_id] = None

    def _exec_recv_grads(self, cmd: schedule.RecvGrad) -> None:
        outputs = self.pipe_buffers["outputs"][cmd.buffer_id]
        if outputs is None:  # nothing was sent (an "absent" marker): nothing comes back
            return
        self.pipe_buffers["output_grads"][cmd.buffer_id] = self.channel.recv_grads(
            outputs, self._next_rank
        )

    def _exec_reduce_tied_grads(self, cmd: schedule.ReduceTiedGrads) -> None:
        del cmd
        self.pipe_module.tied.allreduce_grads(grad_of=self._accumulated_grad)

    def _accumulated_grad(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The gradient of ``weight`` accumulated so far, where the strategy keeps it."""
        record = record_of(weight)
        if record is None or record.group is None:
            return weight.grad
        return record.group.buckets.grad_of(record)

    def _exec_reduce_grads(self, cmd: schedule.ReduceGrads) -> None:
        del cmd
        self.strategy.reduce_now()

    def _exec_optimizer_step(self, cmd: schedule.OptimizerStep) -> None:
        del cmd
        try:
            self._failure.agree("train_batch")
        except BaseException:
            self._optim.zero_grad()  # the failed batch's gradients must not reach the next
            raise
        applied = self._optim.step()
        if applied and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        for _ in range(self.micro_batches):
            self.state.end_micro_step()
        self.state.end_optimizer_step(applied, self.train_batch_size())
        self._report_progress()

    _INSTRUCTION_MAP: dict[type, Callable[[Any, Any], None]] = {
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.SendActivation: _exec_send_activations,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.SendGrad: _exec_send_grads,
        schedule.RecvGrad: _exec_recv_grads,
        schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        schedule.ReduceGrads: _exec_reduce_grads,
        schedule.OptimizerStep: _exec_optimizer_step,
    }

    # -- the loss -----------------------------------------------------------------------------
    def _aggregate_loss(self, losses: list[torch.Tensor], bcast: bool) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses, averaged over its data-parallel
        group, then (``bcast``) sent to every stage of the pipeline."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            total = torch.stack(losses).mean() if losses else total
            if self.is_data_parallel:
                comm.all_reduce(total, group=self.grid.get_data_parallel_group())
                total = total / self.grid.data_parallel_size
        if bcast and self.is_pipe_parallel:
            total = total.reshape(1).contiguous()
            comm.broadcast(
                total,
                src=self.grid.stage_to_global(self.num_stages - 1),
                group=self.grid.get_pipe_parallel_group(),
            )
            total = total.reshape(())
        return total
