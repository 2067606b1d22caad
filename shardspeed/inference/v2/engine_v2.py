"""``InferenceEngineV2``: ragged batches of many sequences over one blocked KV cache.

One :meth:`InferenceEngineV2.put` is one forward pass: every sequence of the batch brings its
next tokens (a whole prompt, a chunk of one, or one decode token), the engine reserves the KV
blocks they need, builds the batch metadata once, runs the pure :class:`RaggedCausalLM` forward
and returns the logits of each sequence's last token. Sequences live until :meth:`flush`.
Scheduling decisions (what to put when) belong to the caller; :meth:`query` and
:meth:`can_schedule` answer what fits (DeepSpeed's semantics).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from shardspeed.accelerator import get_accelerator
from shardspeed.inference.tp_group import SINGLE, TPGroup
from shardspeed.inference.v2.config_v2 import AllocationMode, RaggedInferenceEngineConfig
from shardspeed.inference.v2.graphed_decode import GraphedDecode, graph_refusal
from shardspeed.inference.v2.model.ragged_lm import RaggedCausalLM
from shardspeed.inference.v2.ragged.kv_cache import BlockedKVCache
from shardspeed.inference.v2.ragged.paged_attention import RaggedBatchMetadata, host_to_device
from shardspeed.inference.v2.ragged.state_manager import DSStateManager, TrackedSequence
from shardspeed.inference.v2.scheduling_utils import SchedulingError, SchedulingResult
from shardspeed.inference.v2.serialization import save_model
from shardspeed.utils.logging import logger

__all__ = ["InferenceEngineV2"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _host_ids(tokens: torch.Tensor | Sequence[int]) -> list[int]:
    """Token ids as a list of host ints (a tensor of any shape and device, or ints)."""
    if isinstance(tokens, list) and all(type(t) is int for t in tokens):
        return tokens
    return torch.as_tensor(tokens).reshape(-1).to("cpu", torch.int64).tolist()


class InferenceEngineV2:
    """Runs ``model`` (a :class:`RaggedCausalLM`, or a Hugging Face model to wrap in one) over
    ragged batches under ``config`` (a :class:`RaggedInferenceEngineConfig` or its dict)."""

    def __init__(
        self,
        model: RaggedCausalLM | nn.Module,
        config: RaggedInferenceEngineConfig | dict | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        if config is None or isinstance(config, dict):
            config = RaggedInferenceEngineConfig.from_dict(config or {})
        self._config = config
        self._tp = tp
        self._model = model if isinstance(model, RaggedCausalLM) else RaggedCausalLM(model)
        sm = config.state_manager
        self._block_size = sm.kv_block_size
        self._max_context = sm.max_context
        limit = self._model.max_positions
        if limit is not None and limit < self._max_context:
            logger.info(
                f"inference v2: max_context {self._max_context} -> {limit}, the length of "
                f"{self._model.family}'s learned position table"
            )
            self._max_context = limit
        cache_dtype = config.kv_cache_dtype or self._model.dtype
        # with graphs, one block more than the sequences get: prompt padding writes there
        self._reserved_blocks = int(config.enable_cuda_graph)
        self._cache = BlockedKVCache(
            self._model.num_layers,
            self._num_blocks(cache_dtype) + self._reserved_blocks,
            self._block_size,
            self._model.kv_heads,
            self._model.head_dim,
            dtype=cache_dtype,
            device=self._model.device,
        )
        self._state = DSStateManager(sm, self._cache)
        self.decode_graphs: GraphedDecode | None = None
        """With ``enable_cuda_graph``: runs every decode batch (one new token per sequence,
        nothing scored) and every fresh prompt from CUDA graphs."""
        if config.enable_cuda_graph:
            reason = graph_refusal(self._model, config.tensor_parallel.tp_size)
            if reason is not None:
                raise ValueError(f"enable_cuda_graph: {reason}; set enable_cuda_graph=False.")
            # the extra block, held for good: padding tokens of prompts write there
            scratch = int(self._cache.allocator.allocate(1)[0])
            self.decode_graphs = GraphedDecode(
                self._model, self._cache, self._block_size, sm.max_ragged_sequence_count,
                self._max_context, graph=True, scratch_block=scratch,
                max_prompt_tokens=sm.max_ragged_batch_size,
            )  # fmt: skip
        self.computed_tokens = 0
        """Tokens run through the model so far (prefix-cache hits excluded)."""
        self.prefix_hit_tokens = 0
        """Tokens taken from the prefix cache instead of computed, so far."""
        self.eager_forwards = 0
        """Forwards run by the plain ragged path so far (with ``enable_cuda_graph``: the parts
        of steps that no graph covered)."""

    def _num_blocks(self, dtype: torch.dtype) -> int:
        sm = self._config.state_manager
        memory = sm.memory_config
        if memory.mode == AllocationMode.ALLOCATE:
            return memory.size
        per_block = BlockedKVCache.block_bytes(
            self._model.num_layers, self._block_size, self._model.kv_heads,
            self._model.head_dim, dtype,
        )  # fmt: skip
        # never more than every tracked sequence at full context could use
        most = sm.max_tracked_sequences * _ceil_div(sm.max_context, self._block_size)
        available = get_accelerator().available_memory()
        if self._model.device.type == "cpu":
            # host memory is shared with this process and every other one (zeroed blocks are
            # touched at once): take at most a quarter of what is free
            available //= 4
        blocks = min(most, (available - memory.size) // per_block)
        if blocks < 1:
            raise ValueError(
                f"state_manager.memory_config reserves {memory.size} bytes and leaves no room "
                f"for one KV block ({per_block} bytes); lower memory_config.size or use "
                "mode='allocate' with a number of blocks."
            )
        logger.info(f"inference v2: KV cache of {blocks} blocks of {self._block_size} tokens")
        return int(blocks)

    # ------------------------------------------------------------------ properties
    @property
    def model(self) -> RaggedCausalLM:
        """The ragged model."""
        return self._model

    @property
    def config(self) -> RaggedInferenceEngineConfig:
        return self._config

    @property
    def free_blocks(self) -> int:
        """How many KV blocks new tokens can get now: free blocks plus prefix-cached blocks no
        sequence holds (evicted, least recently used first, when needed)."""
        return self._state.free_blocks

    @property
    def cached_blocks(self) -> int:
        """How many prefix-cached blocks no sequence holds (kept for later prompts, evictable;
        included in :attr:`free_blocks`)."""
        return self._state.cached_blocks

    @property
    def evicted_blocks(self) -> int:
        """Prefix-cached blocks evicted to make room, so far."""
        return self._state.evicted_blocks

    def clear_prefix_cache(self) -> int:
        """Evict every prefix-cached block no sequence holds (they become plainly free) and
        return how many; blocks live sequences hold stay shared."""
        return self._state.clear_prefix_cache()

    @property
    def total_blocks(self) -> int:
        """How many KV blocks the cache has for sequences (with ``enable_cuda_graph`` the
        cache holds one more, where prompt padding writes)."""
        return self._cache.num_blocks - self._reserved_blocks

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block."""
        return self._block_size

    @property
    def max_context(self) -> int:
        """Tokens one sequence may hold."""
        return self._max_context

    @property
    def n_tracked_sequences(self) -> int:
        """How many sequences are tracked now."""
        return self._state.n_tracked_sequences

    @property
    def prefix_index_size(self) -> int:
        """How many blocks the prefix cache indexes now (held by sequences or cached)."""
        return self._state.prefix_index_size

    def tracked(self, uid: int) -> bool:
        """Whether ``uid`` is a live sequence (put and not flushed)."""
        return self._state.get_sequence(uid) is not None

    def seen_tokens(self, uid: int) -> int:
        """How many tokens of ``uid`` are in the cache (0 for an unknown uid)."""
        seq = self._state.get_sequence(uid)
        return 0 if seq is None else seq.seen_tokens

    def prefix_match(self, tokens: Sequence[int] | torch.Tensor) -> int:
        """How many leading tokens a new sequence with prompt ``tokens`` would take from the
        prefix cache (0 without prefix caching)."""
        ids = tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        return len(self._state.match_prefix(ids)) * self._block_size

    @property
    def vocab_size(self) -> int:
        """Rows of the logits ``put`` returns: the model's vocabulary size."""
        return int(self._model.vocab_size)

    def get_remaining_block_capacity(self, uid: int) -> int:
        """Free token slots in the blocks ``uid`` already holds (0 for an unknown uid)."""
        seq = self._state.get_sequence(uid)
        if seq is None:
            return 0
        return seq.cur_allocated_blocks * self._block_size - seq.seen_tokens

    # ------------------------------------------------------------------ scheduling
    def _kv_requirements(
        self, seq: TrackedSequence | None, max_new_tokens: int, max_new_blocks: int
    ) -> tuple[int, int]:
        """(tokens, blocks): how many of ``max_new_tokens`` fit in at most ``max_new_blocks``
        more blocks, and the blocks they need."""
        seen = 0 if seq is None else seq.seen_tokens
        held = 0 if seq is None else seq.cur_allocated_blocks
        needed = max(0, _ceil_div(seen + max_new_tokens, self._block_size) - held)
        if needed <= max_new_blocks:
            return max_new_tokens, needed
        return max(0, (held + max_new_blocks) * self._block_size - seen), max_new_blocks

    def query(self, uid: int, max_request_tokens: int, max_request_blocks: int) -> tuple[int, int]:
        """(tokens, blocks): how many of ``uid``'s next ``max_request_tokens`` tokens can be
        scheduled within ``max_request_blocks`` more KV blocks (and within ``max_context``), and
        how many blocks that needs; (0, 0) for a new uid when no more sequences can be tracked."""
        seq = self._state.get_sequence(uid)
        if seq is None and self._state.n_tracked_sequences >= (
            self._config.state_manager.max_tracked_sequences
        ):
            return 0, 0
        seen = 0 if seq is None else seq.seen_tokens
        tokens = max(0, min(max_request_tokens, self._max_context - seen))
        return self._kv_requirements(seq, tokens, max_request_blocks)

    def can_schedule(self, uids: Iterable[int], lengths: Iterable[int]) -> SchedulingResult:
        """Whether a batch giving each of ``uids`` its ``lengths`` new tokens can run now."""
        uids, lengths = list(uids), list(lengths)
        return self._schedule_result(uids, lengths, [0] * len(uids))

    def _schedule_result(
        self, uids: list[int], lengths: list[int], cached: list[int]
    ) -> SchedulingResult:
        """``can_schedule``, where ``cached[i]`` of sequence ``i``'s new tokens come from the
        prefix cache: they cost no compute, so ``max_ragged_batch_size`` does not count them
        (the KV check still does: an upper bound)."""
        sm = self._config.state_manager
        if len(uids) > sm.max_ragged_sequence_count:
            return SchedulingResult.BatchSequenceLimitExceeded
        tracked = self._state.n_tracked_sequences
        # cached blocks count as free: a batch's prefix hits take at most as many of them as
        # they save in new blocks, so the no-hit estimate below is an upper bound
        free = self._state.free_blocks
        batch_tokens = 0
        for uid, length, hit in zip(uids, lengths, cached, strict=True):
            seq = self._state.get_sequence(uid)
            tracked += seq is None
            if (0 if seq is None else seq.seen_tokens) + length > self._max_context:
                return SchedulingResult.SequenceTokenLimitExceeded
            tokens, blocks = self._kv_requirements(seq, length, free)
            if tokens != length:
                return SchedulingResult.KVCacheLimitExceeded
            free -= blocks
            batch_tokens += length - hit
        if tracked > sm.max_tracked_sequences:
            return SchedulingResult.EngineSequenceLimitExceeded
        if batch_tokens > sm.max_ragged_batch_size:
            return SchedulingResult.BatchTokenLimitExceeded
        return SchedulingResult.Success

    # ------------------------------------------------------------------ the forward
    def put(
        self,
        batch_uids: Iterable[int],
        batch_tokens: Iterable[torch.Tensor | Sequence[int]],
        do_checks: bool = True,
    ) -> torch.Tensor:
        """Run one forward over the batch: ``batch_tokens[i]`` are the next tokens of sequence
        ``batch_uids[i]`` (a new uid starts a sequence). Returns float32 logits
        (len(batch_uids), vocab) of each sequence's last token."""
        return self.put_scored(batch_uids, batch_tokens, (), do_checks)[0]

    def put_scored(
        self,
        batch_uids: Iterable[int],
        batch_tokens: Iterable[torch.Tensor | Sequence[int]],
        scored_uids: Iterable[int],
        do_checks: bool = True,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``put``, and for each uid of ``scored_uids`` in the batch also the float32 logits
        (its new tokens, vocab) at every one of its new tokens (prompt log-probabilities).
        A new scored sequence computes its whole prompt: it adopts no cached prefix."""
        uids = [int(u) for u in batch_uids]
        # token ids as host ints: a tensor may be on any device (the last step's argmax on the
        # GPU, a prompt on the host); the scheduler passes lists and skips the tensors
        runs = [_host_ids(t) for t in batch_tokens]
        scored = {int(u) for u in scored_uids}
        # the cached blocks each new unscored sequence will adopt, matched once: the batch
        # check counts them as computing nothing, and the adoption below takes exactly them
        prefixes = [
            self._state.match_prefix(run)
            if uid not in scored and self._state.get_sequence(uid) is None
            else []
            for uid, run in zip(uids, runs, strict=False)  # a count mismatch: the check says so
        ]
        cached = [len(blocks) * self._block_size for blocks in prefixes]
        self._check_batch(uids, runs, do_checks, cached)

        seqs: list[TrackedSequence] = []
        new_runs: list[list[int]] = []
        # every new sequence adopts its cached prefix before any reserves blocks: a reservation
        # may evict cached blocks, and must not evict those a later sequence of the batch was
        # checked (and charged) as taking from the cache
        for i, uid in enumerate(uids):
            if self._state.get_sequence(uid) is None:
                fresh = self._state.get_or_create_sequence(uid)
                if prefixes[i]:
                    self._state.adopt_prefix(fresh, runs[i], prefixes[i])
                    self.prefix_hit_tokens += cached[i]
                    runs[i] = runs[i][cached[i] :]
        for uid, run in zip(uids, runs, strict=True):
            seq = self._state.get_or_create_sequence(uid)
            self._state.reserve(seq, len(run))
            seq.tokens.extend(run)
            seq.pre_forward(len(run))
            seqs.append(seq)
            new_runs.append(run)

        if not scored.intersection(uids):
            if self.decode_graphs is not None:
                return self._forwarded(seqs, self._graphed(self.decode_graphs, seqs, new_runs)), {}
            return self._forwarded(seqs, self._forward(seqs, new_runs)), {}
        lengths = [len(r) for r in new_runs]
        ends = torch.cumsum(torch.tensor(lengths), 0)
        parts = [ends - 1]
        spans: dict[int, tuple[int, int]] = {}  # scored uid -> its rows in the logits
        at = len(uids)
        for i, uid in enumerate(uids):
            if uid in scored:
                parts.append(torch.arange(int(ends[i]) - lengths[i], int(ends[i])))
                spans[uid] = (at, at + lengths[i])
                at += lengths[i]
        logits = self._forwarded(seqs, self._forward(seqs, new_runs, torch.cat(parts)))
        every = {uid: logits[a:b] for uid, (a, b) in spans.items()}
        return logits[: len(uids)], every

    def _forward(
        self, seqs: list[TrackedSequence], runs: list[list[int]], rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The plain ragged forward of ``runs`` (the new tokens of ``seqs``, reserved): the
        logits of each sequence's last token, or with ``rows`` (host) of those flat rows."""
        self.eager_forwards += 1
        device = self._model.device
        meta = RaggedBatchMetadata.build(
            [s.seen_tokens for s in seqs],
            [len(r) for r in runs],
            [s.block_ids for s in seqs],
            self._block_size,
            device=device,
        )
        flat = host_to_device(torch.tensor([t for r in runs for t in r]), device)
        on_device = None if rows is None else host_to_device(rows, device)
        return self._model(flat, meta, self._cache, on_device)

    def _graphed(
        self, graphs: GraphedDecode, seqs: list[TrackedSequence], runs: list[list[int]]
    ) -> torch.Tensor:
        """The logits of a batch run from ``graphs``: its decode tokens in one graph, each fresh
        prompt in one, anything else (chunks continuing a cached prefix) the plain forward."""
        decode = [i for i, run in enumerate(runs) if len(run) == 1]
        prompts = [
            i
            for i, run in enumerate(runs)
            if len(run) > 1
            and seqs[i].seen_tokens == 0
            and graphs.prompt_bucket_of(len(run)) is not None
        ]
        rest = sorted(set(range(len(runs))) - set(decode) - set(prompts))
        pieces: list[tuple[list[int], torch.Tensor]] = []
        if decode:
            logits = graphs.run(
                [runs[i][0] for i in decode],
                [seqs[i].seen_tokens for i in decode],
                [seqs[i].block_ids for i in decode],
            )
            pieces.append((decode, logits))
        pieces += [([i], graphs.run_prompt(runs[i], seqs[i].block_ids)) for i in prompts]
        if rest:
            pieces.append((rest, self._forward([seqs[i] for i in rest], [runs[i] for i in rest])))
        if len(pieces) == 1:  # one piece holds every row, in order
            return pieces[0][1]
        order = [i for rows, _ in pieces for i in rows]
        logits = torch.cat([piece for _, piece in pieces])
        return logits[host_to_device(torch.tensor(order).argsort(), logits.device)]

    def _forwarded(self, seqs: list[TrackedSequence], logits: torch.Tensor) -> torch.Tensor:
        """``logits``, after the bookkeeping of a forward of the new tokens of ``seqs``."""
        for seq in seqs:
            self.computed_tokens += seq.in_flight_tokens
            seq.post_forward()
            self._state.index_full_blocks(seq)
        return logits

    def capture_decode_graphs(
        self,
        max_sequences: int | None = None,
        max_context: int | None = None,
        max_prompt_tokens: int | None = None,
    ) -> int:
        """With ``enable_cuda_graph``, capture now the graph of every decode batch shape up to
        ``max_sequences`` sequences of ``max_context`` tokens and of every fresh-prompt shape up
        to ``max_prompt_tokens`` tokens (default: the config's limits), as a server does before
        it takes requests, so that no step waits for a capture; returns how many were captured.
        The captures write keys and values only into the engine's scratch block."""
        if self.decode_graphs is None:
            raise ValueError("capture_decode_graphs needs enable_cuda_graph=True in the config.")
        return self.decode_graphs.capture_all(max_sequences, max_context, max_prompt_tokens)

    def _check_batch(
        self,
        uids: list[int],
        runs: list[list[int]],
        do_checks: bool,
        cached: list[int],
    ) -> None:
        """ValueError (nothing changed) for a batch that cannot run as given (``cached[i]``:
        the tokens sequence ``i`` will take from the prefix cache)."""
        if len(uids) != len(runs) or not uids:
            raise ValueError(
                f"put needs one token tensor per uid and at least one uid; got {len(uids)} "
                f"uid(s) and {len(runs)} tensor(s)."
            )
        if len(set(uids)) != len(uids):
            dup = next(u for u in uids if uids.count(u) > 1)
            raise ValueError(
                f"uid {dup} appears twice in one put; give each sequence one run of tokens."
            )
        needed_blocks = 0
        new_uids = sum(self._state.get_sequence(u) is None for u in uids)
        limit = self._config.state_manager.max_tracked_sequences
        if not do_checks and self._state.n_tracked_sequences + new_uids > limit:
            raise SchedulingError(
                SchedulingResult.EngineSequenceLimitExceeded,
                f": {new_uids} new sequence(s) with {self._state.n_tracked_sequences} tracked "
                f"exceed state_manager.max_tracked_sequences={limit}; flush finished sequences.",
            )
        for uid, run in zip(uids, runs, strict=True):
            if len(run) == 0:
                raise ValueError(f"sequence {uid}: put needs at least one token.")
            seq = self._state.get_sequence(uid)
            seen = 0 if seq is None else seq.seen_tokens
            if seen + len(run) > self._max_context:
                raise SchedulingError(
                    SchedulingResult.SequenceTokenLimitExceeded,
                    f": sequence {uid} would hold {seen + len(run)} tokens, over "
                    f"state_manager.max_context={self._max_context}; shorten the request or "
                    "raise max_context.",
                )
            needed_blocks += self._kv_requirements(seq, len(run), 1 << 62)[1]
        if do_checks:
            result = self._schedule_result(uids, [len(r) for r in runs], cached)
            if result != SchedulingResult.Success:
                sm = self._config.state_manager
                raise SchedulingError(
                    result,
                    f": {len(uids)} sequence(s), {sum(len(r) for r in runs)} token(s), "
                    f"{needed_blocks} new KV block(s) of {self._state.free_blocks} free "
                    f"(limits: max_ragged_sequence_count={sm.max_ragged_sequence_count}, "
                    f"max_ragged_batch_size={sm.max_ragged_batch_size}, "
                    f"max_tracked_sequences={sm.max_tracked_sequences}); put fewer tokens or "
                    "flush finished sequences.",
                )
        elif needed_blocks > self._state.free_blocks:
            # without the checks a too-large batch must still fail before changing anything
            raise SchedulingError(
                SchedulingResult.KVCacheLimitExceeded,
                f": the batch needs {needed_blocks} new KV blocks and {self._state.free_blocks} "
                "are free; flush finished sequences or put fewer tokens.",
            )

    def serialize(self, save_path: str | os.PathLike[str]) -> None:
        """Save this rank's model under ``save_path`` (DeepSpeed's file names:
        ``params_rank_{r}_of_{n}.pt``, ``metadata_rank_{r}_of_{n}.json``, and the config from
        rank 0); every rank of a tensor-parallel engine calls it. ``build_hf_engine`` or
        ``build_engine_from_ds_checkpoint`` on the folder loads it back without re-sharding."""
        grain = self._config.tensor_parallel.tp_grain_size
        save_model(self._model.hf_model, self._model.family, save_path, self._tp, grain)

    def flush(self, uid: int) -> None:
        """Forget sequence ``uid`` and free its KV blocks (ValueError when it is not tracked);
        with prefix caching its indexed full blocks stay cached for later prompts."""
        self._state.flush_sequence(uid)
