"""Continuous-batching scheduler with chunked prefill and preemption by recompute (pure Python).

Each ``schedule()`` call builds one step under a token budget (``max_num_batched_tokens``), like
vLLM v1: running requests first (decodes and unfinished prefill chunks, FCFS), then waiting
requests as budget, ``max_num_seqs`` and free blocks allow, in per-tenant fair order (the tenant
with the fewest running requests first; FCFS within a tenant). When a running request cannot get a
block, the most recently admitted running request is preempted: its blocks are freed and it goes
back to the head of the waiting queue to be recomputed later (recompute is never a cache hit).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.stats import SchedulerStats


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: tokens [num_computed_tokens, +num_new_tokens)."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: tuple[int, ...]

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Args:
        kv_cache_manager: owns block tables.
        max_num_seqs: running requests at most (vLLM ``--max-num-seqs``).
        max_num_batched_tokens: tokens per step at most (vLLM ``--max-num-batched-tokens``).
        max_model_len: prompt + output tokens per request at most.
        eos_token_ids: ids that finish a request unless ``ignore_eos``.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 eos_token_ids: Iterable[int] = ()) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request validated by ``engine.protocol.validate_request`` (prompt length and
        vocabulary are not re-checked here). Raises ValueError for a duplicate id."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        assert request.num_tokens < self.max_model_len, "unvalidated request (validate_request)"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finishes (e.g. aborts) requests wherever they are and frees their blocks."""
        assert status.finished
        done = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self.kv.free(req)
            req.status = status
            done.append(req)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            assert num_new > 0, f"{req} running with nothing to compute"
            while (new_blocks := self.kv.allocate_slots(req, num_new)) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if new_blocks is None:
                break
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
            i += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self._next_waiting()
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            req.num_computed_tokens = num_hit_tokens
            if self.kv.allocate_slots(req, num_new, hit_blocks) is None:
                req.num_computed_tokens = 0
                break  # FCFS: later requests wait behind this one
            self.waiting.remove(req)
            self.running.append(req)
            if req.num_cached_tokens < 0:  # first admission: the only time hits count
                req.num_cached_tokens = num_hit_tokens
                if self.kv.uses_prefix_cache(req):
                    self.stats.record_first_admission(req.tenant_id, req.num_tokens,
                                                      num_hit_tokens)
            else:  # re-admission after preemption: recompute, never a hit
                self.stats.record_recompute(req.tenant_id, req.num_tokens - num_hit_tokens)
            req.status = RequestStatus.RUNNING
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new

        return SchedulerOutput(tuple(scheduled), tuple(r.request_id for r in preempted))

    def _next_waiting(self) -> Request:
        """Per-tenant fair admission order.

        A preempted request at the head goes first (it already waited). Otherwise the oldest
        waiting request of the tenant with the fewest running requests is next, so one tenant's
        backlog cannot starve the others; within a tenant the order stays FCFS. If that request
        does not fit, admission stops for this step (no smaller request jumps ahead of it).
        """
        head = self.waiting[0]
        if head.status == RequestStatus.PREEMPTED or len(self.waiting) == 1:
            return head
        running: dict[str | None, int] = {}
        for r in self.running:
            running[r.tenant_id] = running.get(r.tenant_id, 0) + 1
        return min(self.waiting, key=lambda r: running.get(r.tenant_id, 0))  # min is stable

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(req, req.num_computed_tokens, num_new,
                                tuple(self.kv.get_block_ids(req.request_id)))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, output: SchedulerOutput,
                           sampled: dict[str, int]) -> list[Request]:
        """Advances computed tokens, appends sampled tokens, applies token-level stop rules.

        Args:
            output: the step that ran.
            sampled: request id -> sampled token id, for requests whose chunk ``samples``.

        Returns:
            Requests that got a new token this step (finished ones already freed).
        """
        updated = []
        for s in output.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += s.num_new_tokens
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_output_token(token)
            params = req.sampling_params
            if (token in self.eos_token_ids and not params.ignore_eos) \
                    or token in params.stop_token_ids:
                req.stop_reason = token if token in params.stop_token_ids else None
                self._finish(req, RequestStatus.FINISHED_STOPPED)
            elif (params.max_tokens is not None and req.num_output_tokens >= params.max_tokens) \
                    or req.num_tokens >= self.max_model_len:
                self._finish(req, RequestStatus.FINISHED_LENGTH)
            updated.append(req)
        return updated

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.finish_requests([req.request_id], status)
