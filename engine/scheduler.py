"""Continuous-batching scheduler with chunked prefill, fair sharing between tenants and
preemption by recompute (pure Python).

Each ``schedule()`` call builds one step under a token budget (``max_num_batched_tokens``), like
vLLM v1, but the budget is shared between tenants by weighted fair queuing (DESIGN "Multi-tenant
capacity"; start-time fair queuing, Goyal et al. 1996):

- Every tenant with unfinished requests has a virtual time: the tokens scheduled for it so far
  divided by its ``TenantShare.weight``. The budget is handed out in slices of at most
  ``fair_quantum_tokens`` to the tenant with the lowest virtual time, so over a step (and over
  time) each tenant with runnable work gets a share proportional to its weight. Decodes and
  prefill chunks draw on the same budget.
- Within a tenant the order is FCFS: its running requests (in admission order), then its waiting
  requests (queue order). A slice goes to the tenant's first request that still needs tokens.
- A tenant alone gets the whole budget, in exactly the order of plain FCFS.
- A tenant that was idle starts level with the least-served active tenant (it cannot bank
  credit), and no tenant lags more than one step's budget behind the most-served one.
- The pool is shared by weight too (``PoolView``): each tenant with unfinished requests has a
  share of the KV blocks, ``num_blocks * weight / sum of weights``. A waiting request whose
  whole prompt keeps its tenant within that share is admitted on any free block and, when there
  are too few, preempts requests of tenants over their share (``_share_victims``), never leaving
  such a tenant under its share. A request beyond its share takes only free blocks that no
  tenant within its share claims for a prompt this step admits (work conserving, yet a victim
  is not readmitted onto the blocks it gave up: no thrash), and when it does not fit it is passed
  over, with its tenant's later requests: a tenant over its share waits, it is not a wall.
- A waiting request within its share that does not fit stops admission for this step: nothing
  jumps ahead of it, so a large request cannot be starved by a stream of small ones.
- When a running request cannot get a block, a victim is preempted from the tenant holding the
  most KV blocks per unit of weight (its most recently admitted request): its blocks are freed
  and it goes back to the head of the waiting queue. A preempted request is admitted again before
  any fresh request (it already waited) unless the pool's share rule above passes it over.
  Recompute is never a cache hit.
- One step with a preemption admits nothing new beyond a tenant's share.
- With one tenant, or ``policy="fcfs"``, the pool has no shares: exactly vLLM's admission.
- A step is never empty while requests run: when the waiting requests' plans took the whole
  budget and none of them fits, the oldest running request grows (preempting if need be).
- Stall-free batching between tenants (Sarathi-Serve, Agrawal et al. 2024, applied across
  tenants): while a light tenant (all it can run fits its fair share: decodes, a short prompt)
  shares the engine with a heavy one, the step budget is the light tenants' whole need, the
  heavy tenants' decodes and ``interactive_step_tokens`` more, so a tenant's long prompts cannot
  stretch another tenant's inter-token latency or first token by more than that many tokens'
  work.
- ``policy="fcfs"``: none of the above; running requests then waiting ones, in order (vLLM).

Both policies:

- With offload tiers (``engine.kv_offload``): a waiting request whose prefix goes on in a tier
  past its pool hits gets fresh blocks and waits in ``WAITING_FOR_KV_LOAD`` (out of the queues
  and the plans) while the loader fills them; once loaded, the blocks are cached and the request
  waits again, right after the preempted requests, to be admitted with them as hits (vLLM's
  ``WAITING_FOR_REMOTE_KVS``). Its plan this step goes to the requests after it.
- A request preempted in the step that allocated its new blocks leaves none of them cached:
  the step never writes them.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.faults import fire
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request, RequestStatus
from engine.stats import SchedulerStats

logger = logging.getLogger(__name__)

TenantId = str | None

# Largest slice of the token budget handed to one tenant at a time when several compete.
DEFAULT_FAIR_QUANTUM_TOKENS = 16


@dataclass(frozen=True)
class PoolView:
    """The pool as shared by weight, at one moment (``Scheduler._pool_view``).

    A tenant's share is ``num_blocks * weight / (sum of the weights of tenants with unfinished
    requests)``, as the cache's share in ``engine.block_pool``. Its claim: the blocks a tenant
    under its share still needs, up to its share, for its running requests' prompts and for
    each waiting prompt planned this step (it has a seat) that fits in its share by itself.

    Attributes:
        held: tenant -> blocks in the block tables of its running and loading requests.
        share: tenant -> its share of the pool (blocks, fractional).
        claim: tenant under its share -> blocks it claims (> 0).
        num_free: free blocks (cached ones included: evictable).
        block_size: tokens per block.
    """

    held: Counter[TenantId]
    share: dict[TenantId, float]
    claim: dict[TenantId, int]
    num_free: int
    block_size: int

    def within(self, req: Request) -> bool:
        """Whether ``req``'s tenant stays within its share with all of ``req``'s prompt."""
        t = req.tenant_id
        return self.held[t] + cdiv(req.num_tokens, self.block_size) <= self.share[t]


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
    # of those, the ones preempted to admit a tenant within its share of the pool
    share_preempted_ids: tuple[str, ...] = ()
    capped: bool = False  # the stall-free cap limited this step's budget

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
        fair_quantum_tokens: largest budget slice per turn when tenants compete (tokens).
        policy: ``"fair"`` or ``"fcfs"`` (``engine.config.SCHEDULING_POLICIES``).
        interactive_step_tokens: see the module docstring; None or 0 = no such cap (the engine
            sets it from measured step times when configured so).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 eos_token_ids: Iterable[int] = (),
                 fair_quantum_tokens: int = DEFAULT_FAIR_QUANTUM_TOKENS,
                 policy: str = "fair", interactive_step_tokens: int | None = None) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or fair_quantum_tokens < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and fair_quantum_tokens "
                             "must be at least 1")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.fair_quantum_tokens = fair_quantum_tokens
        if policy not in ("fair", "fcfs"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.policy = policy
        self.interactive_step_tokens = interactive_step_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests waiting for blocks of their prefix to load from the offload tiers (by id),
        # and aborted ones whose load still writes into their blocks (freed once it is done).
        self.loading: dict[str, Request] = {}
        self._abandoned_loads: dict[str, Request] = {}
        # Loads in flight whose blocks are of a generation a reset dropped (``discard_loads``).
        self._stale_loads: set[str] = set()
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        # Per tenant with unfinished requests (dropped with its last request):
        self.vtime: dict[TenantId, float] = {}   # tokens scheduled / weight
        self.weights: dict[TenantId, int] = {}
        self.num_unfinished: dict[TenantId, int] = {}
        # Requests failed by a fault of their own in ``schedule``/``update_from_output``, with a
        # client-safe reason; the engine drains this into error outputs.
        self.failed: list[tuple[Request, str]] = []

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request validated by ``engine.protocol.validate_request`` (prompt length and
        vocabulary are not re-checked here). Raises ValueError for a duplicate id."""
        if request.request_id in self.requests or request.request_id in self._abandoned_loads:
            # (an aborted request whose tier load is in flight still holds its id's blocks)
            raise ValueError(f"duplicate request id {request.request_id!r}")
        assert request.num_tokens < self.max_model_len, "unvalidated request (validate_request)"
        t = request.tenant_id
        if t not in self.num_unfinished:  # (re)activated: level with the least-served tenant
            self.vtime[t] = min(self.vtime.values(), default=0.0)
            self.num_unfinished[t] = 0
        self.num_unfinished[t] += 1
        self.weights[t] = request.tenant_share.weight  # the latest request's weight applies
        params = request.sampling_params
        request.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finishes (e.g. aborts) requests wherever they are and frees their blocks. Unknown or
        already finished ids are skipped."""
        assert status.finished
        done = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_KV_LOAD:
                del self.loading[rid]  # its blocks are freed once the loader is done with them
                self._abandoned_loads[rid] = req
            else:
                self.waiting.remove(req)
            if rid not in self._abandoned_loads:
                self.kv.free(req)
            req.status = status
            t = req.tenant_id
            self.num_unfinished[t] -= 1
            if not self.num_unfinished[t]:
                del self.num_unfinished[t], self.vtime[t], self.weights[t]
            done.append(req)
        return done

    def fail_request(self, req: Request, reason: str) -> None:
        """Finishes ``req`` with status ``FINISHED_ERROR`` (blocks freed) and queues it for the
        engine's error output. ``reason`` must be client-safe (no tokens, no prompt text)."""
        if self.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR):
            self.failed.append((req, reason))

    def has_unfinished_requests(self) -> bool:
        """Also True while an aborted request's load is in flight (its blocks are freed when
        the loader is done: the engine steps until then)."""
        return bool(self.waiting or self.running or self.loading or self._abandoned_loads)

    @property
    def loads_pending(self) -> bool:
        """A tier load is in flight (for a waiting request, or an aborted one)."""
        return bool(self.loading or self._abandoned_loads)

    def _finish_loads(self) -> None:
        """Collects finished tier loads: the loaded blocks join the pool's cache and the
        request waits again, first after the preempted requests (it was being admitted), to
        be admitted with them as hits. An aborted request's blocks are only freed."""
        for job in self.kv.offloader.poll_loads():
            req = self._abandoned_loads.pop(job.request_id, None)
            if req is not None:
                self._stale_loads.discard(job.request_id)
                self.kv.free(req)
                continue
            req = self.loading.pop(job.request_id)
            stale = job.request_id in self._stale_loads
            self._stale_loads.discard(job.request_id)
            loaded = self.kv.finish_load(req, job, cache=not stale) * self.kv.block_size
            if req.num_cached_tokens < 0:  # hits count at the first admission only
                req.num_tier_tokens = loaded
            if req.num_preemptions:
                req.status = RequestStatus.PREEMPTED
                self.waiting.appendleft(req)
            else:
                req.status = RequestStatus.WAITING
                self.waiting.insert(sum(1 for r in itertools.takewhile(
                    lambda r: r.status == RequestStatus.PREEMPTED, self.waiting)), req)

    def discard_loads(self, tenant_id: TenantId, every: bool = False) -> None:
        """The loads in flight of ``tenant_id`` (of every tenant with ``every``) will cache
        nothing: a reset during the load dropped their generation (the request computes
        what it would have loaded)."""
        for rid, req in self.loading.items():
            if every or req.tenant_id == tenant_id:
                self._stale_loads.add(rid)

    def _start_load(self, req: Request) -> bool:
        """Starts loading the blocks of waiting ``req``'s prefix that the offload tiers hold
        past its pool hits (``KVCacheManager.start_load``). Returns True when ``req`` now waits
        for its load; False when there is nothing to load or no room for it (``req`` is then
        admitted as usual, computing that part)."""
        hit_blocks, _ = self.kv.get_computed_blocks(req)
        num_tier = self.kv.num_tier_blocks(req, len(hit_blocks), remote=True)
        req.kv_load_tried = True
        if not num_tier or not self.kv.start_load(req, hit_blocks, num_tier):
            return False
        self.waiting.remove(req)
        self.loading[req.request_id] = req
        req.status = RequestStatus.WAITING_FOR_KV_LOAD
        return True

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Builds one step: which requests compute which tokens (see the module docstring).

        Four phases: (1) plan: divide the step's budget (``_step_budget``) between tenants by
        weighted fair queuing, pure arithmetic; (2) running requests, in admission order,
        allocate their planned tokens, preempting when the pool is short; (3) waiting requests
        are admitted in plan order (none after a preemption); (4) budget still unused goes to
        running requests as far as their blocks and the free blocks hold them (never by
        preempting), so the engine always makes progress. Tokens a request cannot use (cache
        hits found at admission, a plan smaller than the budget left) are spare for the
        requests after it, so a lone tenant uses the whole budget; a victim's unused plan is
        left to phase 4.
        """
        if self.kv.offloader is not None:
            self._finish_loads()
        budget, light = self._step_budget()
        plan = self._plan(budget, light)
        # Invariant: used + planned_left <= budget, and every plan is > 0; so an admission's
        # room below is at least its own plan, and the plan's seat count holds.
        planned_left = sum(plan.values())  # plans not yet used
        granted: dict[str, int] = {}  # request id -> tokens this step, in batch order
        used = 0  # sum of granted
        preempted: list[Request] = []

        def refund(reqs: Iterable[Request]) -> None:
            """Tokens granted to ``reqs`` this step go back to the budget (a plan not yet
            used stays reserved: phase 4 may use it, without preempting)."""
            nonlocal used
            for r in reqs:
                n = granted.pop(r.request_id, 0)
                used -= n
                self._charge(r.tenant_id, -n)

        def grow(req: Request, num_new: int) -> None:
            """Running ``req`` computes ``num_new`` tokens this step, preempting while the
            pool is short (``req`` itself may be the victim, or fail)."""
            nonlocal used
            victims: list[Request] = []
            gone = victims
            try:
                fits = self._allocate_running(req, num_new, victims)
            except Exception as e:  # noqa: BLE001 - this request's fault only
                self._fail_in_step(req, e)
                fits, gone = False, [*victims, req]
            preempted.extend(victims)
            refund(gone)
            if fits:
                granted[req.request_id] = num_new
                used += num_new
                self._charge(req.tenant_id, num_new)

        # Phase 2: running requests, in admission order: their plan plus what the plans after
        # them leave unused.
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted above
            planned_left -= plan.pop(req.request_id, 0)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget - planned_left - used)
            if num_new > 0:
                grow(req, num_new)

        # Phase 3: admissions in plan order (preempted requests first). Several tenants under
        # "fair": the pool is shared by weight too (``_admit_fair``); a tenant beyond its share
        # that does not fit is passed over, not a wall for the tenants after it. Otherwise none
        # after a preemption, and the first request that does not fit stops admission.
        fair_pool = self.policy == "fair" and len(self.weights) > 1
        planned_waiting = set(plan)  # (phase 2 took the running requests' plans)
        passed: set[TenantId] = set()  # beyond their share and not admitted: FCFS within them
        share_preempted: list[Request] = []
        view: PoolView | None = None  # computed when first needed, again after a change
        for rid, planned in list(plan.items()):
            planned_left -= planned
            req = self.requests[rid]
            if req.tenant_id in passed:
                continue
            if preempted and not fair_pool:
                break
            if fair_pool and view is None:
                view = self._pool_view(planned_waiting)
            within = view is not None and view.within(req)
            try:
                if preempted and not within:
                    num_new = 0
                elif self.kv.offloader is not None and not req.kv_load_tried \
                        and self._start_load(req):
                    view = None
                    continue  # its plan is left for the requests after it
                elif view is None:
                    num_new = self._admit(req, budget - planned_left - used)
                else:
                    first = len(preempted)
                    num_new = self._admit_fair(req, budget - planned_left - used, view,
                                               within, preempted)
                    share_preempted += preempted[first:]
                    if len(preempted) > first:
                        view = None
                    refund(preempted[first:])
            except Exception as e:  # noqa: BLE001 - this request's fault only
                self._fail_in_step(req, e)
                view = None
                continue
            if num_new == 0:
                if fair_pool and not within:
                    passed.add(req.tenant_id)
                    continue
                break  # FCFS across the pool: nothing jumps ahead of a request that waits
            granted[rid] = num_new
            used += num_new
            self._charge(req.tenant_id, num_new)
            view = None

        # Progress: the plans of waiting requests that cannot be admitted (no free blocks) may
        # hold the whole budget while every running request needs a new block; rather than an
        # empty step (forever), the oldest running request grows, preempting as usual.
        if not granted and self.running:
            req = self.running[0]
            grow(req, min(req.num_tokens - req.num_computed_tokens, budget))

        # Phase 4: budget left unused (a plan a victim or a failed admission did not use) goes
        # to running requests in admission order, as far as their blocks and the free blocks
        # hold them: leftover budget never preempts anyone.
        for req in list(self.running):
            if used == budget:
                break  # the usual case under load: nothing left to hand out
            done = granted.get(req.request_id, 0)
            more = min(req.num_tokens - req.num_computed_tokens - done, budget - used,
                       self.kv.num_addable_tokens(req) - done)
            if more <= 0:
                continue
            try:
                blocks = self.kv.allocate_slots(req, done + more)
            except Exception as e:  # noqa: BLE001 - this request's fault only
                self._fail_in_step(req, e)
                refund([req])
                continue
            assert blocks is not None, "a top-up within the free slots must fit"
            granted[req.request_id] = done + more
            used += more
            self._charge(req.tenant_id, more)

        scheduled = tuple(
            ScheduledRequest(self.requests[rid], self.requests[rid].num_computed_tokens, n,
                             tuple(self.kv.get_block_ids(rid)))
            for rid, n in granted.items())
        self.kv.release_pins()
        return SchedulerOutput(scheduled, tuple(r.request_id for r in preempted),
                               tuple(r.request_id for r in share_preempted),
                               capped=budget < self.max_num_batched_tokens)

    def _step_budget(self) -> tuple[int, set[TenantId]]:
        """``max_num_batched_tokens``, or the stall-free cap while a light tenant shares the
        step with a heavy one (module docstring).

        A tenant is light when all it can run now fits its fair share of the full budget (a
        decode, a short prompt); heavy otherwise. With a light and a heavy tenant, the step is
        the light tenants' whole need, the heavy tenants' decodes and ``interactive_step_tokens``
        more, so a light tenant's tokens (its decodes, or a new prompt) never wait behind a long
        step, nor share theirs with more than that many of a heavy tenant's prefill tokens.
        Light tenants are planned first (max-min fairness: a demand under its fair share is
        served whole), after the first slices of preempted requests, which the step also holds,
        so their need fits the step.

        Returns:
            (the step's budget in tokens, the light tenants to plan first).
        """
        budget = self.max_num_batched_tokens
        if self.policy != "fair" or not self.interactive_step_tokens:
            return budget, set()
        need: Counter[TenantId] = Counter()
        decodes: Counter[TenantId] = Counter()
        for r in self.running:
            n = r.num_tokens - r.num_computed_tokens
            need[r.tenant_id] += n
            decodes[r.tenant_id] += n == 1
        for r in self.waiting:
            need[r.tenant_id] += r.num_tokens
        total_weight = sum(self.weights[t] for t in need)
        light = {t for t, n in need.items() if n * total_weight <= budget * self.weights[t]}
        if not light or len(light) == len(need):
            return budget, set()  # nobody light, or everybody fits anyway (a lone tenant)
        # The light tenants' whole need (planned first), the heavy tenants' decodes and the
        # first slices of their preempted requests (planned before anything: ``_plan``), the cap.
        first_slices = 0
        for r in self.waiting:
            if r.status != RequestStatus.PREEMPTED:
                break
            if r.tenant_id not in light:
                first_slices += min(r.num_tokens, self.fair_quantum_tokens)
        room = (sum(need[t] for t in light) + sum(n for t, n in decodes.items() if t not in light)
                + first_slices + self.interactive_step_tokens)
        return min(budget, room), light

    def _plan(self, budget: int, light: set[TenantId]) -> dict[str, int]:
        """Divides this step's token budget between requests by weighted fair queuing.

        Args:
            budget: the step's token budget (``_step_budget``).
            light: tenants planned before all others (``_step_budget``).

        Returns:
            request id -> planned tokens (> 0), in grant order: phase 2 takes the running
            requests' plans by id, and waiting requests are admitted in this order. Waiting
            requests are planned only while seats (``max_num_seqs``, requests whose tier load
            is in flight counted) remain.
        """
        queues: dict[TenantId, deque[Request]] = {}
        for r in (*self.running, *self.waiting):
            queues.setdefault(r.tenant_id, deque()).append(r)
        if not queues:
            return {}
        lead = max(self.vtime[t] for t in queues)
        for t in queues:  # bounded lag: no tenant banks more than one step of credit
            self.vtime[t] = max(self.vtime[t], lead - self.max_num_batched_tokens)
        vtime = {t: self.vtime[t] for t in queues}
        plan: dict[str, int] = {}
        left: dict[str, int] = {}  # request id -> tokens it may still be planned
        seats = self.max_num_seqs - len(self.running) - len(self.loading)
        if self.policy == "fcfs":
            for r in (*self.running, *self.waiting):
                if r.status != RequestStatus.RUNNING:
                    if seats <= 0:
                        break
                    seats -= 1
                give = min(self._need(r), budget)
                plan[r.request_id] = give
                budget -= give
                if not budget:
                    break
            return plan

        def grant(t: TenantId, req: Request, give: int) -> None:
            nonlocal budget
            rid = req.request_id
            plan[rid] = plan.get(rid, 0) + give
            left[rid] -= give
            budget -= give
            vtime[t] += give / self.weights[t]
            if not left[rid]:
                queues[t].remove(req)

        def seat(req: Request) -> bool:
            """Plans ``req``'s need the first time it is seen; False when a waiting request
            finds no seat."""
            nonlocal seats
            if req.request_id in left:
                return True
            if req.status != RequestStatus.RUNNING:
                if seats <= 0:
                    return False
                seats -= 1
            left[req.request_id] = self._need(req)
            return True

        # When tenants compete, preempted requests (at the head of the waiting queue) get their
        # first slice before anything else: they already waited, whatever their tenant's other
        # requests do. A tenant alone: plain FCFS (running first), as ``fcfs`` and vLLM.
        for req in self.waiting if len(queues) > 1 else ():
            if req.status != RequestStatus.PREEMPTED or not budget or not seat(req):
                break
            grant(req.tenant_id, req, min(left[req.request_id], budget, self.fair_quantum_tokens))
        order = itertools.count()  # ties: first come, first served
        heap = [(t not in light, vtime[t], next(order), t) for t in queues if queues[t]]
        heapq.heapify(heap)
        while heap and budget:
            t = heapq.heappop(heap)[3]
            req = queues[t][0]
            if not seat(req):
                continue  # only waiting requests are left in this tenant's queue
            give = left[req.request_id]
            if heap:  # competing: one slice per turn
                give = min(give, self.fair_quantum_tokens)
            grant(t, req, min(give, budget))
            if queues[t]:
                heapq.heappush(heap, (t not in light, vtime[t], next(order), t))
        return plan

    def _need(self, req: Request) -> int:
        """Tokens ``req`` still computes: a running one, what it has not computed; a waiting
        one, if admitted now, its prompt less the prefix it hits in its own tenant's cache (a
        read-only lookup; admission looks up again, and takes what the plan left room for if
        blocks were evicted in between). Planning the whole prompt instead would hold a
        1,750-token budget for a request that computes 20, so 16 requests on one cached system
        prompt would be admitted two a step (vLLM v1 budgets admissions by their uncached tokens
        too). Blocks cached earlier in this same step are not seen yet: such a request is
        planned its whole prompt, an upper bound."""
        if req.status == RequestStatus.RUNNING:
            return req.num_tokens - req.num_computed_tokens
        return req.num_tokens - self.kv.get_computed_blocks(req)[1]

    def _charge(self, tenant: TenantId, num_tokens: int) -> None:
        """Adds ``num_tokens`` (negative: a refund) to the tenant's service this step."""
        if tenant in self.vtime:  # gone when its last request just failed
            self.vtime[tenant] += num_tokens / self.weights[tenant]

    def _allocate_running(self, req: Request, num_new: int, preempted: list[Request]) -> bool:
        """Allocates slots for ``num_new`` more tokens of running ``req``, preempting victims
        (appended to ``preempted``) while the pool is short; the blocks of loads finished this
        step (``KVCacheManager.release_pins``) are given up before any victim. Returns False
        when ``req`` itself was preempted."""
        while self.kv.allocate_slots(req, num_new) is None:
            if self.kv.release_pins():  # a finished load's blocks give way before anyone
                continue
            victim = self._pick_victim()
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit(self, req: Request, room: int) -> int:
        """Admits waiting ``req`` with up to ``room`` tokens. Returns the tokens granted, or 0
        when the pool cannot fit them (nothing changed)."""
        hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(req)
        num_new = min(req.num_tokens - num_hit_tokens, room)
        req.num_computed_tokens = num_hit_tokens
        if self.kv.allocate_slots(req, num_new, hit_blocks) is None:
            req.num_computed_tokens = 0
            return 0
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.kv_load_tried = False  # a later wait (after a preemption) may load again
        if req.num_cached_tokens < 0:  # first admission: the only time hits count
            req.num_cached_tokens = num_hit_tokens
            # (loaded blocks evicted again before this admission are not hits)
            req.num_tier_tokens = min(req.num_tier_tokens, num_hit_tokens)
            if self.kv.records_prefix_stats(req):
                self.stats.record_first_admission(req.tenant_id, req.num_tokens, num_hit_tokens,
                                                  req.num_tier_tokens)
        else:  # re-admission after preemption: recompute, never a hit
            self.stats.record_recompute(req.tenant_id, req.num_tokens - num_hit_tokens)
        return num_new

    # -- the pool's fair share (policy "fair", several tenants) -----------------------------
    def _pool_view(self, planned: set[str] | frozenset[str] = frozenset()) -> PoolView:
        """Each tenant's blocks held, share of the pool and claim on it, now (``PoolView``);
        waiting requests claim only when ``planned`` (ids) this step."""
        bs = self.kv.block_size
        held: Counter[TenantId] = Counter()
        want: Counter[TenantId] = Counter()  # held, and what its claims would add
        for r in (*self.running, *self.loading.values()):
            n = self.kv.num_blocks_of(r.request_id)
            held[r.tenant_id] += n
            want[r.tenant_id] += max(cdiv(r.num_tokens, bs), n)
        total = sum(self.weights.values())
        num_blocks = self.kv.block_pool.num_blocks
        share = {t: num_blocks * w / total for t, w in self.weights.items()}
        for r in self.waiting:  # only a prompt its tenant's share holds is claimed (two
            if r.request_id not in planned:  # tenants beyond theirs never block each other),
                continue                     # and only one this step admits (has a seat)
            n = cdiv(r.num_tokens, bs)
            if held[r.tenant_id] + n <= share[r.tenant_id]:
                want[r.tenant_id] += n
        # (whole blocks: a share of 2.5 blocks holds 2)
        claim = {t: int(min(s, want[t])) - held[t] for t, s in share.items()
                 if held[t] < int(min(s, want[t]))}
        return PoolView(held, share, claim, self.kv.block_pool.get_num_free_blocks(), bs)

    def _admit_fair(self, req: Request, room: int, view: PoolView, within: bool,
                    preempted: list[Request]) -> int:
        """Admits waiting ``req`` as ``_admit`` does, with the pool shared by weight.

        Within its share (``PoolView.within``), ``req`` takes any free block and, when they
        do not suffice, preempts requests of tenants over their share (``_share_victims``).
        Beyond it, ``req`` takes only free blocks no tenant under its share claims: work
        conserving, yet a victim is not re-admitted onto the blocks it was preempted for
        (no thrash). Returns the tokens granted, or 0 (nothing changed).
        """
        required = self.kv.num_blocks_to_admit(req, room)
        if not within:
            spare = view.num_free - sum(c for t, c in view.claim.items() if t != req.tenant_id)
            return self._admit(req, room) if required <= spare else 0
        if required <= view.num_free:
            return self._admit(req, room)
        victims = self._share_victims(req, view, required - view.num_free)
        if victims is None:
            return 0
        for v in victims:
            self._preempt(v)
            self.stats.num_share_preemptions += 1
            preempted.append(v)
        return self._admit(req, room)

    def _share_victims(self, req: Request, view: PoolView, short: int) -> list[Request] | None:
        """Running requests whose preemption frees ``short`` more blocks for ``req``: each from
        the tenant most over its share per unit of weight, and only while that tenant keeps
        at least its share without it (so a victim's tenant is never left under its share:
        its requests cannot preempt back, and a tenant's only request, however large, is not
        preempted for a share); within a tenant, the request preempted least often, then the
        one with the fewest computed tokens (the least recompute), then the latest admitted.
        None when they cannot free enough (then nobody is preempted)."""
        held = Counter(view.held)
        theirs: dict[TenantId, list[Request]] = {}
        for r in reversed(self.running):  # latest admitted first among equals (stable sort)
            if r.tenant_id != req.tenant_id:
                theirs.setdefault(r.tenant_id, []).append(r)
        for rs in theirs.values():  # first = next to go
            rs.sort(key=lambda r: (r.num_preemptions, r.num_computed_tokens))
        victims: list[Request] = []
        while short > 0:
            best: tuple[float, Request] | None = None
            for t, rs in theirs.items():
                r = next((r for r in rs if held[t] - self.kv.num_blocks_of(r.request_id)
                          >= view.share[t]), None)
                if r is not None and (best is None or held[t] / self.weights[t] > best[0]):
                    best = (held[t] / self.weights[t], r)
            if best is None:
                return None
            victim = best[1]
            theirs[victim.tenant_id].remove(victim)
            victims.append(victim)
            held[victim.tenant_id] -= self.kv.num_blocks_of(victim.request_id)
            short -= self.kv.num_blocks_freed_by(victim)
        return victims

    def _fail_in_step(self, req: Request, error: Exception) -> None:
        """Fails ``req`` after a fault in its own scheduling (e.g. its block allocation)."""
        logger.error("request %s failed while scheduling: %s", req.request_id,
                     type(error).__name__)
        self.kv.uncache_uncomputed(req)  # blocks cached this step that no step will write
        if req.status != RequestStatus.RUNNING:
            req.num_computed_tokens = 0
        self.fail_request(req, "the request failed while its KV blocks were allocated")

    def _pick_victim(self) -> Request:
        """The most recently admitted running request of the tenant holding the most KV blocks
        per unit of weight (the tenant most over its share); with one tenant, plain
        last-admitted-first (vLLM)."""
        held: Counter[TenantId] = Counter()
        last: dict[TenantId, int] = {}  # position of the tenant's last-admitted request
        for i, r in enumerate(self.running):
            held[r.tenant_id] += self.kv.num_blocks_of(r.request_id)
            last[r.tenant_id] = i
        t = max(held, key=lambda t: (held[t] / self.weights[t], last[t]))  # ties: latest
        return self.running[last[t]]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.uncache_uncomputed(req)  # granted in this step: its new blocks were not written
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, output: SchedulerOutput,
                           sampled: dict[str, int]) -> list[Request]:
        """Advances computed tokens, appends sampled tokens, applies token-level stop rules.

        A fault in one request's stop checks fails that request alone (``failed``).

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
                continue  # aborted or failed while the step ran
            req.num_computed_tokens += s.num_new_tokens
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_output_token(token)
            try:
                self._check_stop(req, token)
            except Exception as e:  # noqa: BLE001 - this request's fault only
                logger.error("request %s failed in its stop checks: %s", req.request_id,
                             type(e).__name__)
                req.pop_output_token()  # never delivered: not billed
                self.fail_request(req, "the request failed in its stop checks")
                continue
            updated.append(req)
        return updated

    def _check_stop(self, req: Request, token: int) -> None:
        fire("stop", req.request_id)
        params = req.sampling_params
        if token in req.stop_token_ids and req.num_output_tokens > params.min_tokens:
            req.stop_reason = token if token in params.stop_token_ids else None
            self._finish(req, RequestStatus.FINISHED_STOPPED)
        elif (params.max_tokens is not None and req.num_output_tokens >= params.max_tokens) \
                or req.num_tokens >= self.max_model_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.finish_requests([req.request_id], status)
