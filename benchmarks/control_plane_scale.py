"""The control plane at fleet scale, simulated: object-store operations and tenant admission
latency at 10 / 100 / 1,000 replicas, before (the design at 15a3b8d) and now.

Store operations come from the real code against a counting in-memory store, driven by a
simulated clock: `TenantDirectory.refresh` / `refresh_if_changed` over a directory of 10,000
tenants and keys, `BatchService.queued_batches` over a queue holding 100,000 lines (100 batches),
`fleet.read_view` (the fleet state's one HEAD and LIST), and usage shipping decided by
`usage_log.ship_due`. The schedules are the code's defaults: before, every ingress replica and
batch worker HEADs the directory each second, every batch worker lists the queue each second (and
for its autoscaling figure every 10 s), every ingress replica writes a usage object per 0.1 s in
which a request ended; now, the fleet state reads the store once a second for everyone, idle
workers list every 30 s, usage ships per 2,000 records or 1 s. Batch *work* (claims, renewals,
commits) grows with the lines run, the same before and now, and is left out.

Admission latency is a discrete-event simulation of requests (Poisson, a fixed rate per ingress
replica, tenants drawn from a Zipf law over 10,000, each with a concurrency limit of twice its
expected concurrency, at least 8; requests last 2 s on average) through the
real `TenantUsage` (before: the fleet state admits and releases every request) and the real
`LocalBudget` / `FleetBudget` (now: leases, `tenant_budget_shards` shards), each shard or the
fleet state a single server with `--call-us` of work per call and `--rtt-us` of round trip.

    python benchmarks/control_plane_scale.py --out benchmarks/results/control_plane_scale.json
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log, percentile, write_result  # noqa: E402
from tandem.batch.records import QUEUE_PREFIX  # noqa: E402
from tandem.batch.service import BatchService  # noqa: E402
from tandem.deployments.fleet import read_view  # noqa: E402
from tandem.deployments.openai.endpoints import ENDPOINTS
from tandem.deployments.tenant_leases import RETRY_MARGIN_S, shard_of  # noqa: E402
from tandem.platform.object_store import ObjectNotFound, ObjectStore, PreconditionFailed, StoredObject  # noqa: E402
from tandem.platform.tenancy import TenantLimits, TenantUsage
from tandem.platform.tenant_budget import FleetBudget, LocalBudget  # noqa: E402
from tandem.platform.tenant_directory import DIRECTORY_KEY, TenantDirectory  # noqa: E402
from tandem.platform.usage_log import ship_due  # noqa: E402

# S3 Standard request prices, us-east-1 (USD per 1,000 requests): PUT, COPY, POST, LIST; GET,
# HEAD and the rest. DELETE is free.
PRICE_PER_1000 = {"PUT": 0.005, "LIST": 0.005, "GET": 0.0004, "HEAD": 0.0004, "DELETE": 0.0}


class CountingStore(ObjectStore):
    """An in-memory store that counts each operation under the component named in `component`."""

    def __init__(self) -> None:
        self.url = "mem://control-plane"
        self.objects: dict[str, bytes] = {}
        self.counts: Counter[tuple[str, str]] = Counter()
        self.component = "setup"

    def _count(self, op: str) -> None:
        self.counts[(self.component, op)] += 1

    def count_only(self, op: str) -> None:
        """Count an operation whose object the simulation does not need to keep."""
        self._count(op)

    def get(self, key: str) -> StoredObject:
        self._count("GET")
        if key not in self.objects:
            raise ObjectNotFound(key)
        data = self.objects[key]
        return StoredObject(data, str(hash(data)))

    def head(self, key: str) -> str | None:
        self._count("HEAD")
        data = self.objects.get(key)
        return None if data is None else str(hash(data))

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        self._count("PUT")
        current = self.objects.get(key)
        if if_none_match and current is not None:
            raise PreconditionFailed(key)
        if if_match is not None and (current is None or str(hash(current)) != if_match):
            raise PreconditionFailed(key)
        self.objects[key] = data
        return str(hash(data))

    def delete(self, key: str) -> None:
        self._count("DELETE")
        self.objects.pop(key, None)

    def list(self, prefix: str) -> list[str]:
        self._count("LIST")
        return sorted(k for k in self.objects if k.startswith(prefix))


def build_world(num_tenants: int, num_batches: int, lines_per_batch: int) -> CountingStore:
    """A directory of `num_tenants` tenants with a key each, and `num_batches` queued batches."""
    store = CountingStore()
    tenants = {
        f"t{i:05d}": {"limits": {"max_concurrent_requests": 8}, "weight": 1.0, "created_at": 0}
        for i in range(num_tenants)
    }
    keys = {
        f"key_{i:05d}": {
            "tenant": f"t{i:05d}",
            "digest": f"{i:064x}",
            "prefix": "tdm-abcd",
            "created_at": 0,
            "name": None,
            "expires_at": None,
        }  # fmt: skip
        for i in range(num_tenants)
    }
    store.put(DIRECTORY_KEY, json.dumps({"tenants": tenants, "keys": keys}, sort_keys=True).encode())
    for b in range(num_batches):  # queue pointers as BatchService writes them (the lines stay abstract)
        store.put(
            f"{QUEUE_PREFIX}batch_{b:04d}",
            json.dumps({"tenant": f"t{b:05d}", "batch_id": f"batch_{b:04d}"}).encode(),
        )
    store.counts.clear()
    return store


SAMPLE = 20  # processes simulated per kind; the rest behave the same and are counted by scale


def store_ops(
    num_replicas: int, *, design: str, busy: bool, seconds: int, world: CountingStore, requests_per_s: float
) -> dict[str, Any]:
    """Store operations per second over `seconds` of simulated time (module docstring). Each kind
    of process runs the same schedule: `SAMPLE` of each are simulated, their counts scaled."""
    store = world
    num_workers = max(1, num_replicas // 10)
    num_processes = num_replicas + num_workers
    sampled_processes, sampled_workers = min(num_processes, SAMPLE), min(num_workers, SAMPLE)
    sampled_replicas = min(num_replicas, SAMPLE)
    scale = {
        "directory": num_processes / sampled_processes, "batch_queue": num_workers / sampled_workers,
        "usage": num_replicas / sampled_replicas, "fleet_state": 1.0, "operator": 1.0,
    }  # fmt: skip
    services = [BatchService(store, {"tiny"}, endpoints=ENDPOINTS) for _ in range(sampled_workers)]
    store.component = "setup"
    first = TenantDirectory(store)
    first.refresh()
    directories = [first] + [TenantDirectory(store) for _ in range(sampled_processes - 1)]
    for directory in directories[1:]:  # each process read it once at start (parsed once here)
        directory.adopt(first.snapshot)
    saved = {}
    if not busy:  # nothing queued
        saved = {k: v for k, v in store.objects.items() if k.startswith(QUEUE_PREFIX)}
        for key in saved:
            del store.objects[key]
    view = read_view(store)
    store.counts.clear()
    rng = random.Random(7)
    unshipped = [0] * sampled_replicas
    oldest = [math.inf] * sampled_replicas
    steps_per_s = 10  # 0.1 s ticks
    for tick in range(seconds * steps_per_s):
        now = tick / steps_per_s
        whole_second = tick % steps_per_s == 0
        if busy and whole_second and tick and tick % (60 * steps_per_s) == 0:
            store.component = "operator"
            doc = json.loads(store.objects[DIRECTORY_KEY])
            doc["tenants"]["t00000"]["weight"] = 1.0 + now  # an operator's change, once a minute
            store.put(DIRECTORY_KEY, json.dumps(doc, sort_keys=True).encode())
        if whole_second:
            store.component = "directory"
            if design == "before":
                for directory in directories:
                    directory.refresh()
            else:
                store.component = "fleet_state"
                view = read_view(store)
                store.component = "directory"
                for directory in directories:
                    directory.refresh_if_changed(view.directory_etag)
            store.component = "batch_queue"
            for worker, service in enumerate(services):
                if design == "before":
                    service.queued_batches()  # each poll
                    if (now + worker) % 10 == 0:
                        service.queued_batches()  # the autoscaling figure (its listing)
                elif view.num_queued_batches or (now + worker) % 30 == 0:
                    service.queued_batches()
        if busy:  # usage: requests end at `requests_per_s` per ingress replica
            store.component = "usage"
            for replica in range(sampled_replicas):
                ended = _poisson(rng, requests_per_s / steps_per_s)
                if ended and unshipped[replica] == 0:
                    oldest[replica] = now
                unshipped[replica] += ended
                if design == "before":
                    due = unshipped[replica] > 0  # a flush per 0.1 s with anything to write
                else:
                    due = ship_due(unshipped[replica], now - oldest[replica], 1.0, 2000)
                if due:
                    store.count_only("PUT")  # an object of usage records (not kept: only counted)
                    unshipped[replica] = 0
    store.objects.update(saved)
    by_component: dict[str, dict[str, float]] = {}
    per_s = cost_per_day = 0.0
    for (component, op), count in store.counts.items():
        rate = count * scale[component] / seconds
        by_component.setdefault(component, {})[op] = rate
        per_s += rate
        cost_per_day += rate * 86400 / 1000 * PRICE_PER_1000[op]
    return {
        "ops_per_s": per_s,
        "usd_per_day": cost_per_day,
        "by_component": by_component,
        "batch_workers": num_workers,
    }


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


@dataclass(order=True)
class _Event:
    at: float
    seq: int
    kind: str = field(compare=False)
    data: Any = field(compare=False, default=None)


class _Server:
    """A single server (the fleet state, or one budget shard): FIFO, `call_s` per call."""

    def __init__(self, call_s: float) -> None:
        self.call_s = call_s
        self.free_at = 0.0
        self.num_calls = 0

    def serve(self, arrives: float) -> float:
        """When a call arriving at `arrives` is answered (its work done)."""
        start = max(arrives, self.free_at)
        self.free_at = start + self.call_s
        self.num_calls += 1
        return self.free_at


def admission(
    num_replicas: int,
    *,
    design: str,
    seconds: float,
    requests_per_s: float,
    num_tenants: int,
    call_s: float,
    rtt_s: float,
    local_s: float,
    num_shards: int,
    linger_s: float | None = None,
    seed: int = 11,
) -> dict[str, Any]:
    """Admission latency of every request after a warm-up (module docstring)."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(num_tenants)]
    cumulative = list(itertools.accumulate(weights))
    # Each tenant's limit: twice its expected concurrency, at least 8 (tenants within their
    # limits, as a fleet sized for its customers sees them; bursts still meet the limit).
    mean_duration_s = 2.0
    share = [w / cumulative[-1] for w in weights]
    tenant_limits = {
        f"t{rank:05d}": TenantLimits(
            max_concurrent_requests=max(
                8, math.ceil(2 * share[rank] * requests_per_s * num_replicas * mean_duration_s)
            )
        )
        for rank in range(num_tenants)
    }
    servers = [_Server(call_s) for _ in range(num_shards if design == "now" else 1)]
    fleet_usage = TenantUsage()
    budgets = [FleetBudget() for _ in servers]
    locals_ = [
        LocalBudget() if linger_s is None else LocalBudget(linger_s=linger_s) for _ in range(num_replicas)
    ]
    events: list[_Event] = []
    seq = itertools.count()
    total_rate = requests_per_s * num_replicas
    t = 0.0
    while t < seconds:
        t += rng.expovariate(total_rate)
        tenant = f"t{bisect.bisect_left(cumulative, rng.random() * cumulative[-1]):05d}"
        heapq.heappush(events, _Event(t, next(seq), "arrive", (rng.randrange(num_replicas), tenant)))
    if design == "now":
        for replica in range(num_replicas):
            heapq.heappush(events, _Event(rng.random(), next(seq), "reconcile", replica))
    latencies: list[float] = []
    warmup = seconds / 4
    num_refused = 0
    while events:
        event = heapq.heappop(events)
        now = event.at
        if event.kind == "arrive":
            replica, tenant, *retry = event.data
            first_at = retry[0] if retry else now
            limits = tenant_limits[tenant]
            if design == "before":
                answered = servers[0].serve(now + rtt_s / 2)
                refusal = fleet_usage.try_acquire(tenant, limits, owner=str(replica), now=answered)
                done_at = answered + rtt_s / 2
                admitted = refusal is None
            else:
                local = locals_[replica]
                decided = local.admit(tenant, limits, now)
                if decided is True:
                    done_at, admitted = now + local_s, True
                elif decided is not False:  # refused here (a rate, or a tenant held off)
                    done_at, admitted = now + local_s, False
                else:
                    shard = shard_of(tenant, len(servers))
                    answered = servers[shard].serve(now + rtt_s / 2)
                    granted = budgets[shard].lease(str(replica), tenant, limits, answered)
                    admitted = not isinstance(granted, tuple)
                    done_at = answered + rtt_s / 2
                    if isinstance(granted, tuple) and not retry:  # one more try after a linger
                        at = done_at + local.tight_linger_s + RETRY_MARGIN_S
                        heapq.heappush(events, _Event(at, next(seq), "arrive", (replica, tenant, first_at)))
                        continue
                    if isinstance(granted, tuple):
                        local.lease_refused(tenant, granted, done_at)
                    else:
                        local.leased(tenant, limits, granted)
            now = first_at
            if now >= warmup:
                latencies.append(done_at - now)
            if admitted:
                ends_at = done_at + rng.expovariate(1 / mean_duration_s)
                heapq.heappush(events, _Event(ends_at, next(seq), "end", (replica, tenant)))
            else:
                num_refused += 1
        elif event.kind == "end":
            replica, tenant = event.data
            limits = tenant_limits[tenant]
            if design == "before":
                answered = servers[0].serve(now + rtt_s / 2)
                fleet_usage.release(tenant, 200, owner=str(replica), now=answered)
            elif locals_[replica].release(tenant, 200, now, slot=True, count_tokens=False):
                # a tight tenant's slot goes back if still idle after its short linger
                at = now + locals_[replica].tight_linger_s
                heapq.heappush(events, _Event(at, next(seq), "reconcile_once", replica))
        elif event.kind == "reconcile":
            replica = event.data
            local = locals_[replica]
            report = local.report(now)
            # one shard after the other, as `LeasedTenantLimiter.reconcile` awaits them (each
            # part its own event, so that every server serves its calls in arrival order)
            parts = report.split(lambda name: shard_of(name, len(servers))).items()
            for index, (shard, part) in enumerate(parts):
                at = now + index * (rtt_s + call_s)
                heapq.heappush(events, _Event(at, next(seq), "reconcile_part", (replica, shard, part)))
            if now + 1.0 < seconds:
                heapq.heappush(events, _Event(now + 1.0, next(seq), "reconcile", replica))
        elif event.kind == "reconcile_once":  # as `LeasedTenantLimiter.reconcile` woken early
            replica = event.data
            parts = locals_[replica].report(now).split(lambda name: shard_of(name, len(servers))).items()
            for index, (shard, part) in enumerate(parts):
                at = now + index * (rtt_s + call_s)
                heapq.heappush(events, _Event(at, next(seq), "reconcile_part", (replica, shard, part)))
        elif event.kind == "reconcile_part":
            replica, shard, part = event.data
            answered = servers[shard].serve(now + rtt_s / 2)
            locals_[replica].learn(budgets[shard].reconcile(str(replica), part, answered))
    busy = sum(s.num_calls for s in servers) * call_s / seconds / len(servers)
    return {
        "p50_ms": percentile(latencies, 0.5) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "mean_ms": sum(latencies) / len(latencies) * 1000,
        "requests": len(latencies),
        "refused": num_refused,
        "calls_per_s_per_server": sum(s.num_calls for s in servers) / seconds / len(servers),
        "server_utilisation": busy,
        "servers": len(servers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument(
        "--batches", type=int, default=100, help="queued batches (of --lines-per-batch lines)"
    )
    parser.add_argument("--lines-per-batch", type=int, default=1000)
    parser.add_argument("--store-seconds", type=int, default=120)
    parser.add_argument("--requests-per-s", type=float, default=10.0, help="per ingress replica")
    parser.add_argument("--admission-seconds", type=float, default=20.0)
    parser.add_argument("--call-us", type=float, default=300.0, help="a fleet state or shard's work per call")
    parser.add_argument("--rtt-us", type=float, default=300.0, help="a call's round trip on the network")
    parser.add_argument("--local-us", type=float, default=20.0, help="an admission decided in the replica")
    parser.add_argument(
        "--replicas-per-shard", type=int, default=32, help="ingress replicas per budget shard"
    )
    parser.add_argument(
        "--linger-s", type=float, default=None, help="a freed slot's linger (default: LocalBudget's)"
    )
    parser.add_argument("--out", default="benchmarks/results/control_plane_scale.json")
    args = parser.parse_args()
    world = build_world(args.tenants, args.batches, args.lines_per_batch)
    results: dict[str, Any] = {"store": {}, "admission": {}}
    for num_replicas in args.replicas:
        for busy in (False, True):
            label = f"{num_replicas}-{'busy' if busy else 'idle'}"
            row = {}
            for design in ("before", "now"):
                started = time.perf_counter()
                row[design] = store_ops(
                    num_replicas, design=design, busy=busy, seconds=args.store_seconds, world=world,
                    requests_per_s=args.requests_per_s,
                )  # fmt: skip
                log(f"store {label} {design}: {row[design]['ops_per_s']:.1f} ops/s, "
                    f"${row[design]['usd_per_day']:.2f}/day ({time.perf_counter() - started:.1f} s)")  # fmt: skip
            row["now_over_before"] = row["now"]["ops_per_s"] / row["before"]["ops_per_s"]
            results["store"][label] = row
        row = {}
        for design in ("before", "now"):
            started = time.perf_counter()
            row[design] = admission(
                num_replicas, design=design, seconds=args.admission_seconds, requests_per_s=args.requests_per_s,
                num_tenants=args.tenants, call_s=args.call_us / 1e6, rtt_s=args.rtt_us / 1e6,
                local_s=args.local_us / 1e6, num_shards=max(1, -(-num_replicas // args.replicas_per_shard)),
                linger_s=args.linger_s,
            )  # fmt: skip
            log(f"admission {num_replicas} {design}: p50 {row[design]['p50_ms']:.3f} ms, "
                f"p99 {row[design]['p99_ms']:.3f} ms, utilisation {row[design]['server_utilisation']:.2f} "
                f"({time.perf_counter() - started:.1f} s)")  # fmt: skip
        results["admission"][str(num_replicas)] = row
    first, last = str(args.replicas[0]), str(args.replicas[-1])
    results["summary"] = {
        "idle_ops_now_over_before": {
            str(n): results["store"][f"{n}-idle"]["now_over_before"] for n in args.replicas
        },
        "admission_p50_growth_now": results["admission"][last]["now"]["p50_ms"] / results["admission"][first]["now"]["p50_ms"],
        "admission_p99_growth_now": results["admission"][last]["now"]["p99_ms"] / results["admission"][first]["now"]["p99_ms"],
        "admission_p99_growth_before": results["admission"][last]["before"]["p99_ms"] / results["admission"][first]["before"]["p99_ms"],
    }  # fmt: skip
    results["settings"] = vars(args)
    write_result(args.out, results)
    print(json.dumps(results["summary"], indent=2))


if __name__ == "__main__":
    main()
