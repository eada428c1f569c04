"""The scheduler's requests and where their KV lives (no torch): `RequestQueues`.

It owns the request map, the waiting and running queues (each sorted by `Request.sort_key`),
the requests whose KV is held for hand-over, the tenants' fair shares, and the KV layouts
(`kv/layout.py`): the only way scheduling reaches KV blocks. Admission, the step builder and
the step updates change requests' places only through it, so the queues, the request map and
the fair-share bookkeeping always agree (`Scheduler.check_integrity`).
"""

from __future__ import annotations

import bisect
import time

from tandem.engine.kv.layout import HeadLayout, KVLayout, SharedLayout
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sched.fair_share import FairShare


class RequestQueues:
    def __init__(
        self,
        shared: SharedLayout,
        head_layout: HeadLayout | None,
        fair: FairShare,
        *,
        share_prefix_cache_across_tenants: bool = False,
    ) -> None:
        """`head_layout`: compressed requests' per-head KV (None: the engine has no pool).
        `share_prefix_cache_across_tenants`: cached blocks are keyed by adapter only."""
        self.shared = shared
        self.head_layout = head_layout
        self.fair = fair
        self.share_prefix_cache_across_tenants = share_prefix_cache_across_tenants
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by Request.sort_key()
        self.running: list[Request] = []  # sorted by Request.sort_key()
        self.held: dict[str, Request] = {}  # finished requests whose blocks are kept for hand-over
        self.held_since: dict[str, float] = {}  # when each was held (time.monotonic())
        self.seen_by_runner: set[str] = set()
        self.finished_ids: list[str] = []  # seen by the runner, finished since the last step
        self.num_preemptions_total = 0
        # running requests whose step's results the next step needs (compressed: its eviction;
        # embedding: its pooled state), kept as they start and stop running
        self.num_running_needing_results = 0

    # -- places -------------------------------------------------------------------------
    def add(self, request: Request, status: RequestStatus = RequestStatus.WAITING) -> None:
        """A new request, waiting (or running: its KV was handed over, already filled)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.fair.add(request)
        request.status = status
        if status is RequestStatus.RUNNING:
            self._add_running(request)
        else:
            bisect.insort(self.waiting, request, key=Request.sort_key)

    def start(self, request: Request) -> None:
        """A waiting request holding its blocks starts running (a preemption recomputes it
        alone: it no longer follows a leader's prompt)."""
        self.waiting.remove(request)
        request.fork_of = None
        request.status = RequestStatus.RUNNING
        self._add_running(request)

    def _add_running(self, request: Request) -> None:
        bisect.insort(self.running, request, key=Request.sort_key)
        self.num_running_needing_results += request.compressed or request.embed

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)
        self.num_running_needing_results -= request.compressed or request.embed

    def remove(self, request_id: str, status: RequestStatus) -> Request | None:
        """Take a finished request out of the queues; its blocks are freed, or held when it
        asked to keep them (`Request.hold_kv`) and ended normally (`release_held`)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.fair.remove(request)
        if request in self.running:
            self._remove_running(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        if request.hold_kv and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.held[request_id] = request
            self.held_since[request_id] = time.monotonic()
        else:
            self.free_kv(request_id)
        if request_id in self.seen_by_runner:
            self.seen_by_runner.discard(request_id)
            self.finished_ids.append(request_id)
        return request

    def preempt(self, victim: Request) -> None:
        """Back to waiting, its blocks freed: it restarts from `num_computed_tokens = 0`."""
        self._remove_running(victim)
        self.free_kv(victim.request_id)
        victim.kv_evicted = False  # recomputed from scratch, then evicted again
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self.seen_by_runner.discard(victim.request_id)
        bisect.insort(self.waiting, victim, key=Request.sort_key)

    def mark_seen(self, request_id: str) -> bool:
        """Record that the runner sees the request this step; True the first time."""
        is_new = request_id not in self.seen_by_runner
        self.seen_by_runner.add(request_id)
        return is_new

    def take_finished_ids(self) -> list[str]:
        """Requests the runner saw that finished since the last call (it forgets their state)."""
        finished_ids, self.finished_ids = self.finished_ids, []
        return finished_ids

    # -- held KV (hand-over) --------------------------------------------------------------
    def release_held(self, request_id: str) -> Request | None:
        """Free a held request's blocks (after its KV was exported, or its lease ran out)."""
        request = self.held.pop(request_id, None)
        self.held_since.pop(request_id, None)
        if request is not None:
            self.free_kv(request_id)
        return request

    def expire_held(self, max_age_s: float) -> list[str]:
        """Free the blocks of requests held longer than `max_age_s` (a lease nobody collected)."""
        cutoff = time.monotonic() - max_age_s
        expired = [rid for rid, since in self.held_since.items() if since < cutoff]
        for request_id in expired:
            self.release_held(request_id)
        return expired

    # -- KV -----------------------------------------------------------------------------
    def layout(self, request: Request) -> KVLayout:
        if not request.compressed:
            return self.shared
        assert self.head_layout is not None, "a compressed request on an engine without a head-block pool"
        return self.head_layout

    def free_kv(self, request_id: str) -> None:
        """Give back a request's blocks, whichever layout holds them (a compressed request may
        hold shared blocks of a cached prefix too, for its first step)."""
        self.shared.free(request_id)
        if self.head_layout is not None:
            self.head_layout.free(request_id)

    def allocate(self, request: Request, num_total_tokens: int, admission: bool = False) -> bool:
        """Room for the request's first `num_total_tokens` tokens in its layout (all-or-nothing)."""
        return self.layout(request).allocate(request, num_total_tokens, admission=admission)

    def victim_in_pool(self, request: Request) -> Request:
        """Whom to preempt when `request` needs blocks: among running requests whose blocks come
        from the same pool (preempting another pool's request frees nothing it can use), the
        lowest priority class, the tenant most over its share, its latest arrival."""
        same_pool = [r for r in self.running if r.compressed == request.compressed]
        return self.fair.victim(same_pool or self.running)

    def cache_salt(self, request: Request) -> tuple[str | None, str | None]:
        """What besides the tokens keys a cached block: the adapter, and the tenant unless
        tenants are configured to share cached prefixes."""
        tenant = None if self.share_prefix_cache_across_tenants else request.tenant_id
        return (request.lora_name, tenant)
