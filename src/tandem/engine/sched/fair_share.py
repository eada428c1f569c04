"""Fair shares between tenants inside one priority class (no torch).

A virtual token counter per (priority class, tenant), as in "Fairness in Serving Large Language
Models" (Sheng et al., OSDI 2024): every token a step computes for a tenant's request (prompt
chunk, decode, draft) adds `1 / weight` to its counter. The scheduler then

- orders a class's requests by `order`: first-come first-served within a tenant, and across
  tenants the request whose tenant's counter (plus what the requests placed before it would add)
  is lowest goes first, so prompt chunks and admissions alternate in proportion to the weights;
- gives seats (`max_num_seqs`) in proportion to the weights of the tenants with live requests:
  a waiting request of a tenant under its share takes the seat of the tenant most over its share
  (`seat_victim`);
- preempts, among requests of one class, the tenant most over its share first (`victim`);
- lets a lighter tenant's short new prompt run in a step of its own: the decodes of tenants with
  more running requests per weight (by more than one of their own) sit out that one step
  (`heavier_tenants`), so one tenant's many streams do not multiply another's time to first token.

A tenant that had no live request in a class is lifted to the lowest counter of the tenants that
do when one arrives (`add`), so idle time is not banked as credit. With one tenant (or none:
`tenant_id` None, the offline API) every order is arrival order, as without fairness.

Invariants: `live` counts exactly the requests added and not yet removed, per (class, tenant);
counters never decrease.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from tandem.engine.request import Priority, Request

TenantKey = tuple[Priority, str | None]


class FairShare:
    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        if any(w <= 0 for w in self.weights.values()):
            raise ValueError("tenant weights must be > 0")
        self.counters: dict[TenantKey, float] = defaultdict(float)  # virtual tokens served
        self.live: dict[TenantKey, int] = defaultdict(int)  # requests added, not removed

    def weight(self, tenant_id: str | None) -> float:
        return self.weights.get(tenant_id, 1.0) if tenant_id is not None else 1.0

    @staticmethod
    def key(request: Request) -> TenantKey:
        return (request.priority, request.tenant_id)

    # -- bookkeeping ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """A request became live (waiting or running). A tenant with no other live request in
        its class is lifted to the lowest counter among those that have one. A request that
        carries its tenant's weight (`Request.tenant_weight`, set live by the operator) makes it
        the tenant's weight from now on."""
        if request.tenant_id is not None and request.tenant_weight is not None and request.tenant_weight > 0:
            self.weights[request.tenant_id] = request.tenant_weight
        key = self.key(request)
        if self.live[key] == 0:
            others = [self.counters[k] for k, n in self.live.items() if n > 0 and k[0] is request.priority]
            if others:
                self.counters[key] = max(self.counters[key], min(others))
        self.live[key] += 1

    def remove(self, request: Request) -> None:
        key = self.key(request)
        self.live[key] -= 1
        assert self.live[key] >= 0, f"tenant {key} removed more requests than it added"
        if self.live[key] == 0:
            del self.live[key]

    def charge(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` were computed for the request this step."""
        self.counters[self.key(request)] += num_tokens / self.weight(request.tenant_id)

    def charge_step(self, charges: Iterable[tuple[Request, int]]) -> None:
        """`charge` for each (request, tokens computed) of one step, summed per tenant first."""
        totals: dict[TenantKey, int] = defaultdict(int)
        for request, num_tokens in charges:
            totals[(request.priority, request.tenant_id)] += num_tokens
        for key, num_tokens in totals.items():
            self.counters[key] += num_tokens / self.weight(key[1])

    def counter(self, request: Request) -> float:
        return self.counters[self.key(request)]

    # -- policy -----------------------------------------------------------------------------
    def order(self, requests: Sequence[Request], num_tokens: Callable[[Request], int]) -> list[Request]:
        """`requests` (one class, in arrival order) interleaved fairly: FIFO per tenant; next is
        always the head of the tenant whose counter plus `num_tokens` of its requests already
        placed (divided by its weight) is lowest, ties by arrival."""
        if not requests:
            return []
        tenant_id = requests[0].tenant_id
        if all(request.tenant_id == tenant_id for request in requests):  # one tenant: its own order
            return list(requests)
        queues: dict[str | None, deque[Request]] = {}
        for request in requests:
            queue = queues.get(request.tenant_id)
            if queue is None:
                queue = queues[request.tenant_id] = deque()
            queue.append(request)
        heap = [
            (self.counter(q[0]), q[0].arrival_time, i, tenant) for i, (tenant, q) in enumerate(queues.items())
        ]
        heapq.heapify(heap)
        ordered: list[Request] = []
        while heap:
            projected, _, i, tenant = heapq.heappop(heap)
            queue = queues[tenant]
            request = queue.popleft()
            ordered.append(request)
            if queue:
                projected += num_tokens(request) / self.weight(tenant)
                heapq.heappush(heap, (projected, queue[0].arrival_time, i, tenant))
        return ordered

    def seat_shares(self, priority: Priority, num_seats: int) -> dict[str | None, float]:
        """Each tenant with live requests in the class: its share of `num_seats` by weight."""
        tenants = [k[1] for k in self.live if k[0] is priority]
        total = sum(self.weight(t) for t in tenants)
        return {t: num_seats * self.weight(t) / total for t in tenants}

    def seat_victim(self, request: Request, running: Iterable[Request], num_seats: int) -> Request | None:
        """When `request` waits for a seat (or for room): the latest-arriving running request of
        its class whose tenant holds more seats than its share, most over it first; None unless
        `request`'s tenant is under its own share."""
        same_class = [r for r in running if r.priority is request.priority]
        seats: dict[str | None, int] = defaultdict(int)
        for r in same_class:
            seats[r.tenant_id] += 1
        shares = self.seat_shares(request.priority, num_seats)
        if seats[request.tenant_id] + 1 > shares.get(request.tenant_id, 0.0) + 1e-9:
            return None
        over = {
            t: seats[t] / shares[t] for t in seats if t != request.tenant_id and seats[t] > shares.get(t, 0.0)
        }
        if not over:
            return None
        tenant = max(over, key=lambda t: (over[t], self.counters[(request.priority, t)]))
        return next(r for r in reversed(same_class) if r.tenant_id == tenant)

    def heavier_tenants(self, running: Iterable[Request], newcomers: Iterable[Request]) -> set[str | None]:
        """Tenants holding more running requests per weight than the lightest tenant among
        `newcomers`' (requests about to start), by more than one of their own requests: their
        decodes may sit out one step so that the newcomer's prompt runs in a short step of its own
        (time to first token as on a quiet engine, where a step of every tenant's decodes beside
        it would be several times longer). The one-request margin keeps tenants whose seats
        differ only by rounding (weights 2:1 over 64 seats: 43 and 21) from sitting out every time
        the other admits a prompt, which would cost the heavier weight its share."""
        loads: dict[str | None, float] = defaultdict(float)
        for r in running:
            loads[r.tenant_id] += 1.0 / self.weight(r.tenant_id)
        lightest = min((loads.get(r.tenant_id, 0.0) for r in newcomers), default=None)
        if lightest is None:
            return set()
        return {t for t, load in loads.items() if load - 1.0 / self.weight(t) > lightest + 1e-9}

    def victim(self, candidates: Sequence[Request]) -> Request:
        """Whom to preempt among `candidates` (in `Request.sort_key` order): the lowest-priority
        class first; in it, the tenant most over its share (highest counter); its latest arrival."""
        lowest = max(r.priority for r in candidates)
        in_class = [r for r in candidates if r.priority is lowest]
        top = max(self.counter(r) for r in in_class)
        return next(r for r in reversed(in_class) if self.counter(r) == top)
