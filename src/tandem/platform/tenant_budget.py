"""Tenant limits across many API processes without a round trip per request: budget leases.

The fleet state holds the `FleetBudget`; each ingress replica a `LocalBudget`. Plain classes, no
Ray and no clock of their own (callers pass `now`, monotonic seconds), so a simulation drives the
same code as the servers (`benchmarks/control_plane_scale.py`).

- **Concurrency** (`max_concurrent_requests`) is leased in slots. A replica admits a request on a
  slot it holds; only when it holds none free does it ask the fleet for one (`FleetBudget.lease`),
  which grants while the tenant's slots leased fleet-wide stay under its limit: the limit holds
  exactly. A slot freed by a request's end stays with the replica for `linger_s` (the next
  request of a busy tenant needs no round trip) and is then given back at the replica's next
  `reconcile`; a tenant refused a slot while others linger elsewhere is marked, and every holder
  gives its idle slots back at its next reconcile.
- **Rates** (`tokens_per_minute`, `requests_per_minute`): each replica reports the tokens and
  admissions it counted at its reconcile (every `reconcile_s`, while it has anything to report or
  holds slots) and gets back each tenant's fleet-wide totals for the last minute; it refuses
  locally once those totals plus what it counted since reach the limit. Across replicas a rate
  can be passed by what the others admit within one reconcile period (within one replica, never).
- **A replica that dies** stops reconciling; after `owner_ttl_s` its slots return to the fleet.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.platform.tenancy import CONCURRENCY_LIMITED, RateLimitError, RefusalLog, TenantLimits

WINDOW_S = 60.0

# (message, retry-after seconds, code): a refusal as it crosses a process boundary.
Refusal = tuple[str, float, str]
UNLIMITED = 1 << 30  # the free slots of a tenant without a concurrency limit


@dataclass
class _Window:
    """A tenant's last minute: (time, tokens) and (time, admissions) events."""

    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    admissions: deque[tuple[float, int]] = field(default_factory=deque)

    def totals(self, now: float) -> tuple[int, int, float | None]:
        """(tokens, admissions, time of the oldest event) of the last `WINDOW_S`."""
        for events in (self.tokens, self.admissions):
            while events and events[0][0] <= now - WINDOW_S:
                events.popleft()
        oldest = min((e[0][0] for e in (self.tokens, self.admissions) if e), default=None)
        return sum(n for _, n in self.tokens), sum(n for _, n in self.admissions), oldest


def _margin(limit: int) -> int:
    """Free slots under which a tenant is tight: a quarter of its limit, at least 2."""
    return max(2, limit // 4)


def rate_refusal(
    tenant: str, limits: TenantLimits, tokens: int, admissions: int, oldest: float | None, now: float
) -> RateLimitError | None:
    """The 429 for a tenant that used `tokens` and was admitted `admissions` times in the last
    minute, or None while both are under their limits."""
    retry_after = max(1.0, math.ceil(WINDOW_S - (now - oldest))) if oldest is not None else 1.0
    if limits.tokens_per_minute is not None and tokens >= limits.tokens_per_minute:
        return RateLimitError(
            f"tenant {tenant!r} used {tokens} tokens in the last minute (limit {limits.tokens_per_minute})",
            retry_after_s=retry_after,
            code="tokens_per_minute_exceeded",
        )
    if limits.requests_per_minute is not None and admissions >= limits.requests_per_minute:
        return RateLimitError(
            f"tenant {tenant!r} sent {admissions} requests in the last minute (limit {limits.requests_per_minute})",
            retry_after_s=retry_after,
            code="requests_per_minute_exceeded",
        )
    return None


@dataclass
class Report:
    """What a replica sends at a reconcile, per tenant: slots it gives back, tokens it counted,
    admissions it made, refusals it answered (by code)."""

    returned: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    admissions: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, dict[str, int]] = field(default_factory=dict)
    known: set[str] = field(default_factory=set)  # tenants whose window the replica holds

    @property
    def empty(self) -> bool:
        return not (self.returned or self.tokens or self.admissions or self.refusals)

    def split(self, shard_of: Callable[[str], int]) -> dict[int, Report]:
        """This report cut by the shard each tenant belongs to."""
        parts: dict[int, Report] = {}
        for name in ("returned", "tokens", "admissions", "refusals"):
            for tenant, value in getattr(self, name).items():
                getattr(parts.setdefault(shard_of(tenant), Report()), name)[tenant] = value
        for tenant in self.known:
            parts.setdefault(shard_of(tenant), Report()).known.add(tenant)
        return parts


@dataclass
class Reply:
    """The fleet's answer to a reconcile: per tenant the last minute's (tokens, admissions), and
    the tenants whose idle slots every holder should give back now."""

    windows: dict[str, tuple[int, int, float | None]] = field(default_factory=dict)
    reclaim: set[str] = field(default_factory=set)
    tight: set[str] = field(default_factory=set)  # of the owner's tenants, those near their limits


class FleetBudget:
    """The fleet side (module docstring). Not thread-safe: the fleet state's event loop serialises."""

    def __init__(self, owner_ttl_s: float = 30.0, reclaim_s: float = 2.0) -> None:
        """`reclaim_s`: how long a tenant refused a slot stays marked for its holders to give
        their idle slots back (two reconcile periods)."""
        self.owner_ttl_s = owner_ttl_s
        self.reclaim_s = reclaim_s
        self._held: dict[str, dict[str, int]] = {}  # owner -> tenant -> slots
        self._leased: dict[str, int] = {}  # tenant -> slots leased fleet-wide
        self._windows: dict[str, _Window] = {}
        self._seen: dict[str, float] = {}  # owner -> last lease or reconcile
        self._reclaim: dict[str, float] = {}  # tenant -> when it was refused a slot
        self._limits: dict[str, int] = {}  # tenant -> its concurrency limit, as last leased
        self.refusal_log = RefusalLog()
        self.num_calls = 0  # lease and reconcile calls (what the fleet state serves)

    def leased(self, tenant: str) -> int:
        return self._leased.get(tenant, 0)

    def lease(self, owner: str, tenant: str, limits: TenantLimits, now: float) -> Refusal | int:
        """One concurrency slot of `tenant` for `owner`: the slots still free after it (granted),
        or the refusal (counted)."""
        self.num_calls += 1
        self._seen[owner] = now
        self._drop_silent(now)
        window = self._windows.setdefault(tenant, _Window())
        refusal = rate_refusal(tenant, limits, *window.totals(now), now)
        leased = self._leased.get(tenant, 0)
        if limits.max_concurrent_requests is not None:
            self._limits[tenant] = limits.max_concurrent_requests
        if (
            refusal is None
            and limits.max_concurrent_requests is not None
            and leased >= limits.max_concurrent_requests
        ):
            self._reclaim[tenant] = now  # slots may be idle at other owners: they give them back
            refusal = RateLimitError(
                f"tenant {tenant!r} has {leased} requests in flight (limit {limits.max_concurrent_requests}); "
                "retry when one finishes",
                retry_after_s=1.0,
                code=CONCURRENCY_LIMITED,
            )
        if refusal is not None:
            code = refusal.code or CONCURRENCY_LIMITED
            self.refusal_log.add(tenant, code, 1, now)
            return refusal.message, refusal.retry_after_s, code
        self._leased[tenant] = leased + 1
        held = self._held.setdefault(owner, {})
        held[tenant] = held.get(tenant, 0) + 1
        if limits.max_concurrent_requests is None:
            return UNLIMITED
        return limits.max_concurrent_requests - leased - 1

    def reconcile(self, owner: str, report: Report, now: float) -> Reply:
        """Take `owner`'s report; answer with the windows of the tenants it reported or holds."""
        self.num_calls += 1
        self._seen[owner] = now
        self._drop_silent(now)
        held = self._held.setdefault(owner, {})
        for tenant, count in report.returned.items():
            count = min(count, held.get(tenant, 0))
            held[tenant] = held.get(tenant, 0) - count
            self._leased[tenant] = max(0, self._leased.get(tenant, 0) - count)
            if held[tenant] == 0:
                del held[tenant]
        for tenant, tokens in report.tokens.items():
            self._windows.setdefault(tenant, _Window()).tokens.append((now, tokens))
        for tenant, admissions in report.admissions.items():
            self._windows.setdefault(tenant, _Window()).admissions.append((now, admissions))
        for tenant, by_code in report.refusals.items():
            for code, count in by_code.items():
                self.refusal_log.add(tenant, code, count, now)
        tenants = set(report.tokens) | set(report.admissions) | set(held) | report.known
        windows = {t: self._windows[t].totals(now) if t in self._windows else (0, 0, None) for t in tenants}
        self._reclaim = {t: when for t, when in self._reclaim.items() if when > now - self.reclaim_s}
        tight = {
            t
            for t in held
            if t in self._limits and self._limits[t] - self._leased.get(t, 0) < _margin(self._limits[t])
        }
        return Reply(windows, set(self._reclaim) & set(held), tight)

    def _drop_silent(self, now: float) -> None:
        for owner in [o for o, seen in self._seen.items() if seen < now - self.owner_ttl_s]:
            for tenant, count in self._held.pop(owner, {}).items():
                self._leased[tenant] = max(0, self._leased.get(tenant, 0) - count)
            del self._seen[owner]


@dataclass
class _Slots:
    held: int = 0  # leased from the fleet
    in_use: int = 0
    idle_since: float = 0.0  # when in_use last dropped below held
    tight: bool = False  # the tenant was near its limit at the last lease: freed slots go back at once


class LocalBudget:
    """One replica's side (module docstring). Not thread-safe: the replica's event loop serialises.

    A tenant the fleet refused a slot is refused here for `hold_s` (or until one of its slots here
    frees) without asking again: a tenant far over its limit costs its shard one call per replica
    per `hold_s`, not one per request."""

    def __init__(self, linger_s: float = 0.5, hold_s: float = 0.25, tight_linger_s: float = 0.1) -> None:
        """A freed slot stays `linger_s` for the tenant's next request here, `tight_linger_s` when
        the tenant was near its limit at its last lease (other replicas may need it)."""
        self.linger_s = linger_s
        self.tight_linger_s = tight_linger_s
        self.hold_s = hold_s
        self._held_off: dict[str, tuple[float, RateLimitError]] = {}  # tenant -> (until, the fleet's 429)
        self._slots: dict[str, _Slots] = {}
        self._windows: dict[str, tuple[int, int, float | None]] = {}  # the fleet's, as last told
        self._pending = Report()  # counted since the last reconcile
        self.refusal_log = RefusalLog()

    def admit(self, tenant: str, limits: TenantLimits, now: float) -> RateLimitError | bool:
        """Admit on what this replica knows: a refusal (rate over its limit, counted), True when
        admitted on a slot it holds (or no slot is needed), False when a slot must be leased."""
        tokens, admissions, oldest = self._windows.get(tenant, (0, 0, None))
        tokens += self._pending.tokens.get(tenant, 0)
        admissions += self._pending.admissions.get(tenant, 0)
        refusal = rate_refusal(tenant, limits, tokens, admissions, oldest if oldest is not None else now, now)
        if refusal is not None:
            self._count_refusal(tenant, refusal.code or "rate_limited", now)
            return refusal
        if limits.max_concurrent_requests is None:
            self._admitted(tenant, limits)
            return True
        slots = self._slots.setdefault(tenant, _Slots())
        if slots.in_use < slots.held:
            slots.in_use += 1
            self._admitted(tenant, limits)
            return True
        held_off = self._held_off.get(tenant)
        if held_off is not None and now < held_off[0]:
            self._count_refusal(tenant, held_off[1].code or CONCURRENCY_LIMITED, now)
            return held_off[1]
        return False

    def lease_refused(self, tenant: str, refusal: Refusal, now: float) -> RateLimitError:
        """The fleet refused a slot: hold the tenant off here for `hold_s`; the 429 to raise."""
        message, retry_after_s, code = refusal
        error = RateLimitError(message, retry_after_s=retry_after_s, code=code)
        if code == CONCURRENCY_LIMITED:
            self._held_off[tenant] = (now + self.hold_s, error)
        return error

    def leased(self, tenant: str, limits: TenantLimits, num_free: int = UNLIMITED) -> None:
        """The fleet granted a slot for the request `admit` could not place: it is in use.
        `num_free`: the tenant's slots still free fleet-wide after it; under a quarter of its limit
        (or 2), the tenant is tight, and a slot freed here lingers only `tight_linger_s` (enough
        for the next request of a busy tenant here, not so long that other replicas go short)."""
        slots = self._slots.setdefault(tenant, _Slots())
        slots.held += 1
        slots.in_use += 1
        limit = limits.max_concurrent_requests
        slots.tight = limit is not None and num_free < _margin(limit)
        self._admitted(tenant, limits)

    def _admitted(self, tenant: str, limits: TenantLimits) -> None:
        if limits.requests_per_minute is not None:  # counted only where a rate needs it
            self._pending.admissions[tenant] = self._pending.admissions.get(tenant, 0) + 1

    def _count_refusal(self, tenant: str, code: str, now: float) -> None:
        by_code = self._pending.refusals.setdefault(tenant, {})
        by_code[code] = by_code.get(code, 0) + 1
        self.refusal_log.add(tenant, code, 1, now)

    def release(
        self, tenant: str, num_tokens: int, now: float, *, slot: bool, count_tokens: bool = True
    ) -> bool:
        """A request ended, having used `num_tokens` (counted when `count_tokens`: its tenant has a
        tokens-per-minute limit); `slot`: it held one of the tenant's slots. True when the freed
        slot is a tight tenant's: the caller reconciles after `tight_linger_s` rather than at its
        next period (an idle slot then goes back; one in use again stays)."""
        if num_tokens and count_tokens:
            self._pending.tokens[tenant] = self._pending.tokens.get(tenant, 0) + num_tokens
        slots = self._slots.get(tenant)
        if slot and slots is not None and slots.in_use > 0:
            slots.in_use -= 1
            slots.idle_since = now
            self._held_off.pop(tenant, None)
            return slots.tight
        return False

    def add_idle_slot(self, tenant: str) -> None:
        """A slot the fleet granted to a request that went away before it could use it: held,
        idle, and given back at the next report."""
        slots = self._slots.setdefault(tenant, _Slots())
        slots.held += 1
        slots.idle_since = -math.inf

    def needs_reconcile(self) -> bool:
        """Whether there is anything to report, slots to give back, or a window to bring up to date."""
        return not self._pending.empty or any(s.held for s in self._slots.values()) or bool(self._windows)

    def report(self, now: float, reclaim: set[str] | frozenset[str] = frozenset()) -> Report:
        """What to send now: the counts since the last report, and the idle slots to give back
        (lingered `linger_s`, or every idle one of a tenant in `reclaim`)."""
        for tenant, slots in self._slots.items():
            idle = slots.held - slots.in_use
            linger = self.tight_linger_s if slots.tight else self.linger_s
            if idle > 0 and (tenant in reclaim or now - slots.idle_since >= linger - 1e-9):
                slots.held -= idle
                self._pending.returned[tenant] = self._pending.returned.get(tenant, 0) + idle
        self._slots = {t: s for t, s in self._slots.items() if s.held or s.in_use}
        self._held_off = {t: h for t, h in self._held_off.items() if h[0] > now}
        report, self._pending = self._pending, Report()
        report.known = set(self._windows)
        return report

    def restore(self, report: Report) -> None:
        """A report that did not arrive: count it again in the next one (slots given back stay
        given back here; the fleet frees them when this owner's ttl passes, at worst)."""
        for mine, theirs in ((self._pending.tokens, report.tokens), (self._pending.admissions, report.admissions),
                             (self._pending.returned, report.returned)):  # fmt: skip
            for tenant, count in theirs.items():
                mine[tenant] = mine.get(tenant, 0) + count
        for tenant, by_code in report.refusals.items():
            for code, count in by_code.items():
                mine_codes = self._pending.refusals.setdefault(tenant, {})
                mine_codes[code] = mine_codes.get(code, 0) + count

    def learn(self, reply: Reply) -> None:
        """The fleet's windows (a tenant with nothing in its last minute is forgotten) and which
        of this replica's tenants are near their limits now (their freed slots linger briefly)."""
        for tenant in reply.tight:  # set here, cleared by a lease that leaves room
            if tenant in self._slots:
                self._slots[tenant].tight = True
        for tenant, window in reply.windows.items():
            if window[0] or window[1]:
                self._windows[tenant] = window
            else:
                self._windows.pop(tenant, None)
