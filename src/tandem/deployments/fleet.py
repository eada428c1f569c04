"""`FleetState`: what the fleet's processes must agree on, in one small deployment replica.

- **Engine figures of every LLM replica**, for the ingress's one `/metrics`. A deployment handle
  reaches some replica, not each one, so the replicas report instead: each sends its engine stats
  whenever Serve collects its routing stats (`RoutingConfig.stats_period_s`), and the ingress reads
  them all at once. A replica that stops reporting (it died, or was scaled down) drops out after
  `stats_ttl_s`.
- **The drain before a stop**: `tandem serve`, on SIGTERM, starts it here; the ingress and batch
  worker replicas see it within `DRAIN_POLL_S` (`watch_drain`) and report their requests in
  flight until none is left.

- **The store's view for the fleet** (`FleetView`): with an object store, the fleet state HEADs
  the tenant directory and lists the batch queue every `tenant_refresh_s`, and hands both to every
  member with the drain poll: a member reads the directory only when its etag changed
  (`TenantRegistry.directory_seen`), an idle batch worker lists the queue only when it holds
  work (`BatchWorker.queue_seen`). One HEAD and one LIST per interval for the whole fleet, not
  one per replica.

One replica per application. Its state is soft: a restarted `FleetState` has every replica's
figures again after one reporting period. (Tenant limits across several ingress replicas live in
their own deployments: tenant_leases.py.)
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ray.serve.handle import DeploymentHandle

from tandem.batch.records import QUEUE_PREFIX
from tandem.deployments.autoscaling import ScalingTargets, desired_replicas
from tandem.platform.object_store import ObjectStore
from tandem.platform.store_guard import open_object_store
from tandem.platform.tenant_directory import DIRECTORY_KEY

logger = logging.getLogger("tandem.fleet")

# The autoscaling history: one sample per this many seconds, kept for an hour.
SCALING_SAMPLE_S = 10.0
SCALING_HISTORY_S = 3600.0
# The Serve deployment name of the fleet state.
FLEET_STATE_DEPLOYMENT = "FleetState"
# How often a drain member reports (and so how soon it sees a drain), and how long one that
# stopped reporting still counts.
DRAIN_POLL_S = 0.5
MEMBER_TTL_S = 5.0


@dataclass(frozen=True)
class FleetView:
    """What the fleet state last read of the store. `known` False: no store, or it did not answer
    (members then read for themselves)."""

    known: bool = False
    directory_etag: str | None = None  # None: there is no directory
    num_queued_batches: int = 0


def read_view(store: ObjectStore) -> FleetView:
    """One reading of the store for the fleet: a HEAD of the directory, a LIST of the queue."""
    try:
        return FleetView(True, store.head(DIRECTORY_KEY), len(store.list(QUEUE_PREFIX)))
    except Exception:  # noqa: BLE001 - unknown while the store is down: members read theirs
        return FleetView()


async def watch_drain(
    fleet: DeploymentHandle,
    in_flight: Callable[[], int],
    on_drain: Callable[[float], Awaitable[None] | None],
    on_view: Callable[[FleetView], None] | None = None,
) -> None:
    """A drain member's loop (run as a task for the replica's life): report `in_flight()` every
    `DRAIN_POLL_S`; once the fleet drains, call `on_drain(seconds left)` once and keep reporting
    (the CLI waits for every member's in-flight count to reach 0). `on_view` gets the fleet
    state's `FleetView` of the store at each poll where it has one."""
    member = uuid.uuid4().hex
    drained = False
    while True:
        try:
            deadline, view = await fleet.drain_state.remote(member, in_flight())
            if on_view is not None and view.known:
                on_view(view)
        except Exception:  # the fleet state restarted or is unreachable: try again next poll
            deadline = None
        if deadline is not None and not drained:
            drained = True
            result = on_drain(max(0.0, deadline - time.time()))
            if result is not None:
                await result
        await asyncio.sleep(DRAIN_POLL_S)


class FleetState:
    def __init__(
        self,
        stats_ttl_s: float = 10.0,
        scaling_targets: dict[str, Any] | None = None,
        object_store: str | None = None,
        directory_poll_s: float = 1.0,
    ) -> None:
        """`scaling_targets`: the KV-occupancy autoscaling policy's `ScalingTargets` fields (None:
        the engine replicas do not autoscale; the history then has no target). `object_store`:
        where the tenant directory is, HEADed every `directory_poll_s` (None: no directory)."""
        if stats_ttl_s <= 0:
            raise ValueError(f"stats_ttl_s must be > 0, got {stats_ttl_s}")
        self.stats_ttl_s = stats_ttl_s
        self.scaling_targets = ScalingTargets(**scaling_targets) if scaling_targets is not None else None
        self._scaling: deque[dict[str, Any]] = deque()  # the last hour's samples, oldest first
        self._last_sample = -math.inf
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}  # replica id -> (when, stats)
        self._drain_deadline: float | None = None  # epoch seconds, once a drain began
        self._drain_began: float | None = None  # time.monotonic() when it began
        self._members: dict[str, tuple[float, int]] = {}  # drain member -> (last report, in flight)
        self._view = FleetView()
        self._stop = threading.Event()
        if object_store is not None:
            threading.Thread(
                target=self._watch_directory,
                args=(object_store, directory_poll_s),
                name="directory-watch",
                daemon=True,
            ).start()

    def _watch_directory(self, object_store: str, poll_s: float) -> None:
        store = open_object_store(object_store)
        while not self._stop.is_set():
            self._view = read_view(store)
            self._stop.wait(poll_s)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()

    # -- engine figures ---------------------------------------------------------------------
    def report(self, replica_id: str, stats: dict[str, Any]) -> None:
        now = time.monotonic()
        self._reports[replica_id] = (now, stats)
        if now - self._last_sample >= SCALING_SAMPLE_S:
            self._last_sample = now
            self._sample_scaling()

    def _sample_scaling(self) -> None:
        """One sample of the engine replicas (not prefill ones) as the autoscaling policy sees
        them: how many report, and how many the policy wants for their KV occupancy and queues
        (the same `desired_replicas`, before Serve's up- and downscale delays)."""
        live = [s for s in self.snapshot().values() if s.get("role") != "prefill"]
        kv = [float(s.get("kv_occupancy", 0.0)) for s in live]
        waiting = [float(s.get("num_waiting", 0)) for s in live]
        target = (
            desired_replicas(len(live), kv, waiting, self.scaling_targets) if self.scaling_targets else None
        )
        now = time.time()
        self._scaling.append({
            "time": now, "replicas": len(live), "target": target,
            "kv_occupancy": sum(kv) / len(kv) if kv else 0.0, "num_waiting": sum(waiting),
        })  # fmt: skip
        while self._scaling and self._scaling[0]["time"] < now - SCALING_HISTORY_S:
            self._scaling.popleft()

    def scaling_history(self) -> list[dict[str, Any]]:
        """The last hour's samples (every `SCALING_SAMPLE_S`): time (epoch s), replicas reporting,
        the policy's target, mean KV occupancy, requests waiting."""
        return list(self._scaling)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Replica id -> its latest stats, for replicas that reported within `stats_ttl_s`."""
        cutoff = time.monotonic() - self.stats_ttl_s
        for replica_id in [rid for rid, (when, _) in self._reports.items() if when < cutoff]:
            del self._reports[replica_id]
        return {rid: stats for rid, (_, stats) in self._reports.items()}

    # -- graceful stop ----------------------------------------------------------------------
    def begin_drain(self, timeout_s: float) -> float:
        """Start the fleet's drain (`tandem serve` on SIGTERM): members (ingress and batch worker
        replicas) see it at their next `drain_state` call. Returns the drain's end (epoch
        seconds); a second call keeps the first end."""
        if self._drain_deadline is None:
            self._drain_deadline = time.time() + timeout_s
            self._drain_began = time.monotonic()
        return self._drain_deadline

    def drain_state(self, member: str, num_in_flight: int) -> tuple[float | None, FleetView]:
        """A member's report of its requests in flight; (the drain's end once a drain began, the
        store's `FleetView`)."""
        self._members[member] = (time.monotonic(), num_in_flight)
        return self._drain_deadline, self._view

    def drain_progress(self) -> tuple[int, int, int]:
        """(members heard from lately, of which reported since the drain began, requests in
        flight they reported then)."""
        now = time.monotonic()
        live = {m: (when, n) for m, (when, n) in self._members.items() if when > now - MEMBER_TTL_S}
        began = self._drain_began if self._drain_began is not None else now
        since = [n for when, n in live.values() if when >= began]
        return len(live), len(since), sum(since)
