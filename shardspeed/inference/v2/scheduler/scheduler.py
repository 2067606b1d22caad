"""Continuous batching with Dynamic SplitFuse over an ``InferenceEngineV2``.

Each ``step`` builds one ragged batch and makes one ``engine.put``: first the decode token of
every running sequence (oldest admitted first), then prompt chunks fill what is left of the
step's token budget, first for admitted sequences whose prompt is not done, then for newly
admitted requests in arrival order (a long prompt is split over several steps; only the step
with its last chunk samples a token). A request is admitted when the engine says its chunk's KV
blocks fit (``engine.query``). When a decode token needs a block and none is free, the
newest-admitted sequence is preempted: flushed from the engine and requeued first with its prompt
plus generated tokens as the prompt to recompute; its sampler generator carries on, so its tokens
are those of an unpreempted run.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from shardspeed.inference.v2.scheduler.logprobs import record_prompt_logprobs, step_logprobs
from shardspeed.inference.v2.scheduler.requests import (
    FinishReason,
    Request,
    ScheduledChunk,
    TokenEvent,
)
from shardspeed.inference.v2.scheduler.sampling import (
    SamplingParams,
    adjust_logits,
    make_generator,
    sample,
    suppress_tokens,
)

__all__ = ["RaggedScheduler", "SchedulableEngine"]


class SchedulableEngine(Protocol):
    """What the scheduler uses of ``InferenceEngineV2``."""

    @property
    def free_blocks(self) -> int: ...

    @property
    def total_blocks(self) -> int: ...

    @property
    def kv_block_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def put(
        self,
        batch_uids: Iterable[int],
        batch_tokens: Iterable[torch.Tensor | Sequence[int]],
        do_checks: bool = ...,
    ) -> torch.Tensor: ...

    def put_scored(
        self,
        batch_uids: Iterable[int],
        batch_tokens: Iterable[torch.Tensor | Sequence[int]],
        scored_uids: Iterable[int],
        do_checks: bool = ...,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]: ...

    def query(
        self, uid: int, max_request_tokens: int, max_request_blocks: int
    ) -> tuple[int, int]: ...

    def flush(self, uid: int) -> None: ...


def _state_limit(engine: Any, name: str) -> int | None:
    """``engine``'s ``state_manager.<name>`` limit when its config exposes one."""
    config = getattr(engine, "config", None) or getattr(engine, "_config", None)
    value = getattr(getattr(config, "state_manager", None), name, None)
    return value if isinstance(value, int) else None


class RaggedScheduler:
    """Schedules requests over ``engine`` (an ``InferenceEngineV2``) one ragged batch per step.

    ``token_budget``: most tokens per step (default: the engine's ``max_ragged_batch_size``, else
    768). ``eos_token_ids``: end-of-sequence tokens that stop a request unless its params say
    ``ignore_eos``. ``max_sequences``: most sequences per step (default: the engine's
    ``max_ragged_sequence_count``, else 512).
    """

    def __init__(
        self,
        engine: SchedulableEngine,
        token_budget: int | None = None,
        eos_token_ids: int | Iterable[int] | None = None,
        max_sequences: int | None = None,
    ) -> None:
        batch_limit = _state_limit(engine, "max_ragged_batch_size")
        seq_limit = _state_limit(engine, "max_ragged_sequence_count")
        if token_budget is None:
            token_budget = batch_limit or 768
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
            raise ValueError(f"token_budget must be an integer >= 1, got {token_budget!r}.")
        if batch_limit is not None and token_budget > batch_limit:
            raise ValueError(
                f"token_budget={token_budget} exceeds the engine's max_ragged_batch_size="
                f"{batch_limit}; lower token_budget or raise state_manager.max_ragged_batch_size."
            )
        if max_sequences is None:
            max_sequences = seq_limit or 512
        if max_sequences < 1 or (seq_limit is not None and max_sequences > seq_limit):
            raise ValueError(
                f"max_sequences must be in 1..{seq_limit or 'inf'} (the engine's "
                f"max_ragged_sequence_count), got {max_sequences}."
            )
        if eos_token_ids is None:
            eos: frozenset[int] = frozenset()
        elif isinstance(eos_token_ids, int):
            eos = frozenset([eos_token_ids])
        else:
            eos = frozenset(int(t) for t in eos_token_ids)
        vocab = getattr(engine, "vocab_size", None)
        if isinstance(vocab, int) and any(not 0 <= t < vocab for t in eos):
            raise ValueError(
                f"eos_token_ids {sorted(eos)} must be token ids of the model's vocabulary "
                f"(0..{vocab - 1})."
            )
        self.engine = engine
        self.token_budget = token_budget
        self.max_sequences = max_sequences
        # the engine tracks at most this many sequences: one step admits no more than it has
        # room for (query only counts those tracked before the step)
        self.max_tracked = _state_limit(engine, "max_tracked_sequences")
        config = getattr(engine, "config", None) or getattr(engine, "_config", None)
        manager = getattr(config, "state_manager", None)
        # the engine's prefix_match (tokens a new sequence would take from its prefix cache),
        # None when it caches no prefixes
        self.prefix_match: Any = (
            getattr(engine, "prefix_match", None)
            if getattr(manager, "prefix_caching", False)
            else None
        )
        self.eos_token_ids = eos
        self._waiting: deque[Request] = deque()
        # Insertion order is admission order: the last entry is the newest-admitted sequence.
        self._running: dict[int, Request] = {}
        self._next_uid = 0
        self._arrivals = 0
        self.num_steps = 0
        self.num_preemptions = 0
        self.last_step: list[ScheduledChunk] = []

    # ------------------------------------------------------------------ requests
    @property
    def has_work(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet (or preempted and requeued)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests the engine holds KV blocks for."""
        return len(self._running)

    def _in_use(self, uid: int) -> bool:
        return uid in self._running or any(r.uid == uid for r in self._waiting)

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError unless a request of ``prompt_ids`` with ``params`` can ever run: its
        prompt plus ``max_new_tokens - 1`` tokens (the last token is never fed back) must fit the
        engine's ``max_context`` and its KV cache."""
        if len(prompt_ids) == 0:
            raise ValueError("a request needs at least one prompt token, got an empty prompt.")
        cached = len(prompt_ids) + params.max_new_tokens - 1
        if cached > self.engine.max_context:
            raise ValueError(
                f"the request needs {cached} tokens of context (prompt {len(prompt_ids)} + "
                f"max_new_tokens {params.max_new_tokens} - 1) and the engine's max_context is "
                f"{self.engine.max_context}; shorten the prompt or lower max_new_tokens."
            )
        vocab = getattr(self.engine, "vocab_size", None)
        # an id past the vocabulary would index out of the logits (a stop id suppressed on a
        # GPU: a device-side assert that ends the process's use of the device)
        named = (("logit_bias", list(params.logit_bias)), ("stop_token_ids", params.stop_token_ids))
        for name, ids in named:
            if isinstance(vocab, int) and ids and max(ids) >= vocab:
                raise ValueError(
                    f"{name} names token id {max(ids)}; the model's vocabulary has {vocab} "
                    f"tokens (ids 0..{vocab - 1})."
                )
        block = self.engine.kv_block_size
        blocks = -(-cached // block)
        if blocks > self.engine.total_blocks:
            raise ValueError(
                f"the request needs {blocks} KV blocks of {block} tokens (prompt "
                f"{len(prompt_ids)} + max_new_tokens {params.max_new_tokens} - 1 = {cached} "
                f"tokens) and the cache has {self.engine.total_blocks}; shorten the request or "
                "give the cache more memory."
            )

    def add_request(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        params: SamplingParams,
        uid: int | None = None,
    ) -> int:
        """Queue a request and return its uid (``uid``, or the next free one)."""
        if isinstance(prompt_ids, torch.Tensor):
            prompt = [int(t) for t in prompt_ids.reshape(-1).tolist()]
        else:
            prompt = [int(t) for t in prompt_ids]
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}.")
        self.check_request(prompt, params)
        if uid is None:
            while self._in_use(self._next_uid):
                self._next_uid += 1
            uid = self._next_uid
            self._next_uid += 1
        elif self._in_use(uid):
            raise ValueError(f"uid {uid} is in use by an unfinished request; pick another uid.")
        request = Request(uid=uid, prompt=prompt, params=params, arrival=self._arrivals)
        self._arrivals += 1
        if params.do_sample:
            # Made at arrival, not at the first sample, so that unseeded requests draw their
            # seeds from torch's global generator in a repeatable order.
            request.generator = make_generator(params)
        self._waiting.append(request)
        return uid

    def abort(self, uid: int) -> bool:
        """Drop request ``uid`` and free its KV blocks; False when no such request is
        unfinished (it may have just finished)."""
        if uid in self._running:
            request = self._running.pop(uid)
            if request.computed:
                self.engine.flush(uid)
            return True
        for request in self._waiting:
            if request.uid == uid:
                self._waiting.remove(request)
                return True
        return False

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[TokenEvent]:
        """Run one ragged batch through the engine and return the tokens it generated."""
        if not self.has_work:
            self.last_step = []
            return []
        chunks = self._compose()
        requests = [self._running[c.uid] for c in chunks]
        # lists of ints: the engine reads the ids on the host (no tensor per sequence)
        tokens = [r.tokens(c.start, c.length) for r, c in zip(requests, chunks, strict=True)]
        uids = [c.uid for c in chunks]
        scored = [c.uid for r, c in zip(requests, chunks, strict=True) if r.scores_prompt]
        if scored:
            logits, every = self.engine.put_scored(uids, tokens, scored)
            for request, chunk in zip(requests, chunks, strict=True):
                if chunk.uid in every:
                    record_prompt_logprobs(request, chunk, every[chunk.uid])
        else:
            logits = self.engine.put(uids, tokens)
        self.num_steps += 1
        self.last_step = chunks
        # stop tokens before min_new_tokens made -inf, then every greedy pick of the step in
        # one argmax (sampled requests draw from their own row)
        stops: list[frozenset[int]] = []
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for i, (request, chunk) in enumerate(zip(requests, chunks, strict=True)):
            ends = self._stops(request) if chunk.samples else frozenset()
            stops.append(ends)
            if ends and len(request.generated) < request.params.min_new_tokens:
                banned_rows += [i] * len(ends)
                banned_tokens += ends
        host, with_logprobs, greedy = _picks(logits, requests, chunks, banned_rows, banned_tokens)
        now = time.monotonic()
        events = []
        for i, (request, chunk) in enumerate(zip(requests, chunks, strict=True)):
            request.computed += chunk.length
            if chunk.samples:
                row = None if host is None else host[i]
                event = self._sample(request, row, greedy[i], stops[i], now)
                if i in with_logprobs:
                    scores, top = with_logprobs[i]
                    event = dataclasses.replace(
                        event, logprob=float(scores[event.token]), top_logprobs=top
                    )
                if request.params.prompt_logprobs is not None and len(request.generated) == 1:
                    event = dataclasses.replace(
                        event, prompt_logprobs=tuple(request.prompt_entries)
                    )
                events.append(event)
        return events

    def run_to_completion(self) -> dict[int, list[int]]:
        """Step until no request is left; the generated tokens of every request that finished
        meanwhile, by uid."""
        outputs: dict[int, list[int]] = {}
        while self.has_work:
            for event in self.step():
                outputs.setdefault(event.uid, []).append(event.token)
        return outputs

    def _stops(self, request: Request) -> frozenset[int]:
        """The tokens that end ``request``: its stop tokens, and end-of-sequence unless it
        ignores it."""
        stops = frozenset(request.params.stop_token_ids)
        return stops if request.params.ignore_eos else stops | self.eos_token_ids

    def _sample(
        self,
        request: Request,
        logits: torch.Tensor | None,
        greedy: int,
        stops: frozenset[int],
        now: float,
    ) -> TokenEvent:
        """Draw ``request``'s next token from ``logits`` (its stop tokens already -inf before
        ``min_new_tokens``; ``greedy``: their argmax; None when the request reads no logits);
        finish it (flush) on a stop token or its length. ``now``: the step's time stamp."""
        params = request.params
        if params.do_sample:
            assert logits is not None, "a sampling request's row comes to the host"
            token = sample(logits, params, request.generator)
        else:
            token = greedy
        request.generated.append(token)
        reason: FinishReason | None = None
        if token in stops:
            reason = "stop"
        elif len(request.generated) >= params.max_new_tokens:
            reason = "length"
        if reason is not None:
            del self._running[request.uid]
            self.engine.flush(request.uid)
        return TokenEvent(request.uid, token, reason is not None, reason, emitted_at=now)

    # ------------------------------------------------------------------ batch composition
    def _compose(self) -> list[ScheduledChunk]:
        """This step's chunks: decode tokens first, then prompt chunks (SplitFuse)."""
        while True:
            batch = _Batch(self)
            self._schedule_decodes(batch)
            self._schedule_prefills(batch)
            if batch.chunks:
                return list(batch.chunks.values())
            if not self._running:
                raise RuntimeError(
                    f"cannot schedule request {self._waiting[0].uid} with no sequence running: "
                    f"the engine has {self.engine.free_blocks} of {self.engine.total_blocks} KV "
                    "blocks free (something outside this scheduler holds the rest)."
                )
            # Every running sequence waits for blocks another holds: free the newest.
            self._preempt(next(reversed(self._running)), batch)

    def _schedule_decodes(self, batch: _Batch) -> None:
        """One token for each sequence past its prompt, preempting the newest when blocks run
        out."""
        for uid in list(self._running):
            request = self._running.get(uid)
            if request is None or request.computed == 0 or request.pending != 1:
                continue  # preempted meanwhile, or still in its prompt
            if batch.full:
                return
            while True:
                if batch.try_add(request, 1):
                    break
                victim = next(reversed(self._running))
                self._preempt(victim, batch)
                if victim == uid:
                    break

    def _schedule_prefills(self, batch: _Batch) -> None:
        """Prompt chunks: unfinished prompts of admitted sequences, then new admissions."""
        for request in list(self._running.values()):
            if batch.full:
                return
            if request.uid not in batch.chunks and request.pending > 0:
                batch.try_add(request, min(batch.budget, request.pending))
        # A prompt whose first block another prompt still being computed shares waits for
        # it (n choices of one prompt, say): then it adopts that prompt's cached blocks and
        # computes only its own tail, where admitted together each would compute it all.
        # The others keep their order and are admitted meanwhile.
        computing = self._prompts_computing()
        for request in list(self._waiting):
            if batch.full:
                return
            # a prompt computed whole (its log-probabilities scored) adopts nothing: no wait
            key = None if request.scores_prompt else self._first_block(request)
            holder = computing.get(key) if key is not None else None
            if holder is not None and self._waits_for(request, holder):
                continue
            if not batch.try_add(request, min(batch.budget, request.pending), admit=True):
                return
            if key is not None:
                computing.setdefault(key, request)

    def _waits_for(self, request: Request, holder: Request) -> bool:
        """Whether ``request`` should wait for ``holder``: their prompts share full blocks that
        ``holder`` has not computed yet and the prefix cache does not hold already."""
        block = self.engine.kv_block_size
        mine, theirs = request.prompt, holder.prompt
        shared = 0
        while (
            shared + block < len(mine)  # a block it could adopt leaves it a token to compute
            and shared + block <= len(theirs)
            and mine[shared : shared + block] == theirs[shared : shared + block]
        ):
            shared += block
        if shared <= holder.computed:
            return False
        return int(self.prefix_match(mine)) < shared

    def _first_block(self, request: Request) -> tuple[int, ...] | None:
        """The first KV block's tokens of ``request``'s prompt, when the prefix cache could give
        them to another prompt (None: prefix caching off, or no full block before its last
        token)."""
        block = self.engine.kv_block_size
        if self.prefix_match is None or len(request.prompt) <= block:
            return None
        return tuple(request.prompt[:block])

    def _prompts_computing(self) -> dict[tuple[int, ...], Request]:
        """First block -> the (first) running request with that first block whose prompt is
        not all computed."""
        found: dict[tuple[int, ...], Request] = {}
        for request in self._running.values():
            key = self._first_block(request)
            if key is not None and request.computed < len(request.prompt):
                found.setdefault(key, request)
        return found

    def _preempt(self, uid: int, batch: _Batch) -> None:
        """Flush sequence ``uid`` and requeue it first to recompute prompt + generated."""
        request = self._running.pop(uid)
        batch.remove(uid)
        if request.computed:
            self.engine.flush(uid)
        request.computed = 0
        request.admitted_at = None
        request.preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(request)


def _picks(
    logits: torch.Tensor,
    requests: list[Request],
    chunks: list[ScheduledChunk],
    banned_rows: list[int],
    banned_tokens: list[int],
) -> tuple[torch.Tensor | None, dict[int, tuple[torch.Tensor, Any]], list[int]]:
    """From a step's ``logits`` (on the engine's device), with token ``banned_tokens[i]`` of
    row ``banned_rows[i]`` made -inf: the logits on the host (None when no request needs its
    row there), the log-probabilities asked for, and every row's greedy pick."""
    if not any(c.samples and r.params.reads_logits for r, c in zip(requests, chunks, strict=True)):
        # every pick is greedy, nothing adjusted or reported: the argmax where the logits are,
        # and only the token ids come back (not a vocabulary-wide row per sequence)
        picked = logits.detach()
        if banned_rows:
            picked = suppress_tokens(picked, banned_rows, banned_tokens)
        return None, {}, picked.argmax(dim=-1).tolist()
    # Sampling runs on the CPU with CPU generators: the same draws whatever the device.
    host = logits.detach().float().cpu()
    with_logprobs = step_logprobs(host, requests, chunks)
    if banned_rows:
        host = suppress_tokens(host, banned_rows, banned_tokens)
    host = _adjusted(host, requests, chunks)
    return host, with_logprobs, host.argmax(dim=-1).tolist()


def _adjusted(
    logits: torch.Tensor, requests: list[Request], chunks: list[ScheduledChunk]
) -> torch.Tensor:
    """``logits`` with the rows of sampling requests that ask for a logit bias or penalties
    adjusted (a copy when any is; the same tensor when none is)."""
    rows = [
        i
        for i, (r, c) in enumerate(zip(requests, chunks, strict=True))
        if c.samples and r.params.adjusts_logits
    ]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        request = requests[i]
        out[i] = adjust_logits(logits[i], request.params, request.prompt_ids, request.generated)
    return out


class _Batch:
    """A step's batch under construction: its chunks and the tokens/blocks they take."""

    def __init__(self, scheduler: RaggedScheduler) -> None:
        self.scheduler = scheduler
        self.chunks: dict[int, ScheduledChunk] = {}
        self.blocks: dict[int, int] = {}
        self.blocks_taken = 0  # sum(self.blocks.values()), kept as chunks come and go
        self.budget = scheduler.token_budget
        self.new_uids: set[int] = set()  # sequences this batch starts in the engine
        self.charged: dict[int, int] = {}  # the budget each chunk takes (cached tokens free)
        self.block_size = scheduler.engine.kv_block_size

    @property
    def full(self) -> bool:
        """No token or sequence slot left."""
        return self.budget <= 0 or len(self.chunks) >= self.scheduler.max_sequences

    def try_add(self, request: Request, want: int, admit: bool = False) -> bool:
        """Add up to ``want`` of ``request``'s pending tokens if the KV cache has room for at
        least one; ``admit`` moves it from the waiting queue to the running set."""
        engine = self.scheduler.engine
        starts = request.computed == 0  # untracked until this batch puts it
        limit = self.scheduler.max_tracked
        if starts and limit is not None:
            tracked = int(getattr(engine, "n_tracked_sequences", 0))
            if tracked + len(self.new_uids) >= limit:
                return False
        covered = self._cached(request) if starts else 0
        if covered:  # cached tokens cost no compute: the budget buys tokens past them
            want = min(request.pending, covered + self.budget)
        free = engine.free_blocks - self.blocks_taken
        tokens, blocks = engine.query(request.uid, want, free)
        if tokens > 0 and self._charge(tokens, covered) > self.budget:
            # the KV cache cut the chunk below its cached part: what is left of the budget
            # buys tokens past the blocks the shorter chunk still adopts
            want = min(covered, (tokens - 1) // self.block_size * self.block_size) + self.budget
            tokens, blocks = engine.query(request.uid, want, free)
        charged = self._charge(tokens, covered)
        if tokens <= 0 or charged > self.budget:
            return False
        if starts:
            self.new_uids.add(request.uid)
        if admit:
            waiting = self.scheduler._waiting
            if waiting[0] is request:
                waiting.popleft()
            else:
                waiting.remove(request)
            self.scheduler._running[request.uid] = request
            request.admitted_at = self.scheduler.num_steps
        self.chunks[request.uid] = ScheduledChunk(
            request.uid, request.computed, tokens, samples=tokens == request.pending
        )
        self.blocks[request.uid] = blocks
        self.blocks_taken += blocks
        self.charged[request.uid] = charged
        self.budget -= charged
        return True

    def _charge(self, tokens: int, covered: int) -> int:
        """What the engine computes of a ``tokens`` chunk whose first ``covered`` tokens are
        cached: it adopts the cached blocks the chunk holds whole, leaving at least its last
        token to compute (as the engine's match does)."""
        return tokens - min(covered, max(0, (tokens - 1) // self.block_size * self.block_size))

    def _cached(self, request: Request) -> int:
        """How many of a starting ``request``'s tokens the engine's prefix cache holds (0 when
        it scores its prompt: such a sequence computes it whole)."""
        match = self.scheduler.prefix_match
        if match is None or request.scores_prompt:
            return 0
        return int(match(request.tokens(0, request.pending)))

    def remove(self, uid: int) -> None:
        """Take ``uid``'s chunk out again (it was preempted)."""
        chunk = self.chunks.pop(uid, None)
        self.new_uids.discard(uid)
        if chunk is not None:
            self.budget += self.charged.pop(uid)
            self.blocks_taken -= self.blocks.pop(uid)
