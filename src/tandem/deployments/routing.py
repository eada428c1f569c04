"""Which LLM replica serves a request: adapter affinity, prefix affinity, then least load.

A Ray Serve request router (`TandemRouter`, public `ray.serve.request_router` API) runs inside
every process that holds a handle to the LLM replicas (the ingress, the batch workers). For each
request it ranks the replicas; Serve then sends the request to the replica with the shortest
queue in the first rank that has one with room.

The ranking (`rank_replicas`, a pure function) is:

1. **Affinity.** A request for an adapter prefers the replicas that hold it: those that report it
   (Serve's multiplexing) and those this router already sent it to (reports lag by a second or
   more; without this, a burst for a new adapter would load it on every replica). A request
   without an adapter prefers the replica whose prefix cache most likely holds the longest
   prefix of its prompt (`PrefixIndex`: which replica each prompt prefix was sent to), when that
   prefix is at least `min_match_fraction` of the prompt; a shared system prompt alone does not
   pin every chat to one replica.
2. **Load guard.** A preferred replica is dropped when it has `max_imbalance` more requests in
   flight than the least-loaded replica, or its KV cache is `kv_saturation` full: a second copy
   of an adapter, or a recomputed prefix, costs less than a queue.
3. **Placement.** A request with no (usable) affinity is placed at ranking time (`place`): an
   adapter, or a prompt of at least one chunk, by rendezvous hashing of the adapter name or the
   prompt's first chunk over the replicas within the load guard (so that every router, with no
   word between them, places the same adapter or prefix on the same replica); anything else on
   the least-loaded replica. The placement is recorded at once, so that a burst of requests
   sharing a new prefix or adapter follows the first one instead of spreading before any of
   them is routed. The other replicas follow, by load, saturated ones last.

Invariants: every candidate replica appears in exactly one rank (a request is never left
unroutable by the policy); the index is bounded (`max_index_entries`, least recently used out)
and forgets replicas that are gone.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from tandem.engine.protocol import GenerationRequest

# A placement this router made counts as "holds the adapter" for this long without the replica
# reporting it (Serve's multiplexing reports lag; a replica may also have evicted it since).
ADAPTER_PLACEMENT_TTL_S = 30.0
MAX_PENDING_DIGESTS = 4096


class RoutingConfig(BaseModel):
    """The LLM replicas' request routing (`AppConfig.routing`)."""

    model_config = ConfigDict(extra="forbid")

    prefix_chunk_chars: int = Field(
        128, ge=1, description="Prompt characters per prefix-index entry (token ids: a quarter as many)"
    )
    max_prefix_chunks: int = Field(256, ge=1, description="Prompt chunks indexed per request")
    min_match_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Share of a prompt a replica must hold before prefix affinity applies",
    )
    max_imbalance: int = Field(
        8,
        ge=0,
        description="Requests in flight a preferred replica may have beyond the least-loaded one",
    )
    kv_saturation: float = Field(
        0.95, gt=0.0, le=1.0, description="KV occupancy at which a replica is preferred only last"
    )
    max_index_entries: int = Field(100_000, ge=1, description="Prefix-index entries kept per router")
    stats_period_s: float = Field(1.0, gt=0.0, description="How often replicas report KV occupancy")

    def serve_options(self) -> dict[str, object]:
        """The `request_router_config` of the LLM replicas' deployment."""
        return {
            "request_router_class": "tandem.deployments.routing:TandemRouter",
            "request_router_kwargs": self.model_dump(exclude={"stats_period_s"}),
            "request_routing_stats_period_s": self.stats_period_s,
            "request_routing_stats_timeout_s": max(self.stats_period_s, 1.0),
        }


@dataclass(frozen=True)
class ReplicaLoad:
    """What the ranking knows of one replica."""

    replica_id: str
    num_ongoing: int  # requests in flight from this router's view (Serve's queue-length cache)
    kv_occupancy: float  # as last reported by the replica (0 before its first report)


def prefix_hashes(request: GenerationRequest, chunk_chars: int, max_chunks: int) -> tuple[list[str], int]:
    """Chained digests of the prompt's leading chunks, and the prompt's length in chunk units.

    Digest `i` identifies the prompt's first `i + 1` chunks, so two prompts share digest `i` exactly
    when they share that much prefix. A trailing partial chunk is not indexed (no cache can share
    it yet). Chat messages are serialised role by role, so conversations that share their first
    turns share digests."""
    units: Sequence[Any]
    if request.prompt_token_ids is not None:
        units, size = request.prompt_token_ids, max(1, chunk_chars // 4)
    elif request.messages is not None:
        units = "".join(json.dumps(m, sort_keys=True, ensure_ascii=False) for m in request.messages)
        size = chunk_chars
    else:
        units, size = request.prompt or "", chunk_chars
    num_full = min(len(units) // size, max_chunks)
    digests: list[str] = []
    chained = hashlib.blake2b(digest_size=16)
    chained.update((request.lora_name or "").encode())  # adapters have caches of their own
    for i in range(num_full):
        chunk = units[i * size : (i + 1) * size]
        chained.update(chunk.encode() if isinstance(chunk, str) else repr(list(chunk)).encode())
        digests.append(chained.copy().hexdigest())
    return digests, max(1, -(-len(units) // size))


class PrefixIndex:
    """Which replicas each prompt prefix was sent to (bounded, least recently used out)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._replicas_by_digest: OrderedDict[str, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replicas_by_digest)

    def match(self, digests: Sequence[str]) -> dict[str, int]:
        """Replica id -> how many leading chunks of `digests` were sent to it."""
        matched: dict[str, int] = {}
        for i, digest in enumerate(digests):
            holders = self._replicas_by_digest.get(digest)
            if not holders:
                break
            self._replicas_by_digest.move_to_end(digest)
            for replica_id in holders:
                if matched.get(replica_id) == i:  # its match is contiguous up to here
                    matched[replica_id] = i + 1
                elif i == 0:
                    matched[replica_id] = 1
        return matched

    def record(self, digests: Iterable[str], replica_id: str) -> None:
        for digest in digests:
            holders = self._replicas_by_digest.setdefault(digest, set())
            holders.add(replica_id)
            self._replicas_by_digest.move_to_end(digest)
        while len(self._replicas_by_digest) > self.max_entries:
            self._replicas_by_digest.popitem(last=False)

    def forget_replicas(self, live_replica_ids: set[str]) -> None:
        for digest in list(self._replicas_by_digest):
            holders = self._replicas_by_digest[digest]
            holders &= live_replica_ids
            if not holders:
                del self._replicas_by_digest[digest]


def rank_replicas(
    loads: Sequence[ReplicaLoad], affinity: dict[str, float], config: RoutingConfig
) -> list[list[str]]:
    """Replica ids in ranks, most preferred first (see the module docstring).

    `affinity`: replica id -> score (higher is better; absent or 0: none). Every replica in
    `loads` is in exactly one rank; empty ranks are left out."""
    if not loads:
        return []
    least = min(r.num_ongoing for r in loads)
    preferred = [
        r
        for r in loads
        if affinity.get(r.replica_id, 0) > 0
        and r.num_ongoing <= least + config.max_imbalance
        and r.kv_occupancy < config.kv_saturation
    ]
    ranks: list[list[str]] = []
    if preferred:
        best = max(affinity[r.replica_id] for r in preferred)
        ranks.append([r.replica_id for r in preferred if affinity[r.replica_id] == best])
    ranked = {rid for rank in ranks for rid in rank}
    roomy = [r for r in loads if r.replica_id not in ranked and r.kv_occupancy < config.kv_saturation]
    saturated = [r for r in loads if r.replica_id not in ranked and r.kv_occupancy >= config.kv_saturation]
    for group in (roomy, saturated):
        if group:
            ranks.append([r.replica_id for r in sorted(group, key=lambda r: (r.num_ongoing, r.kv_occupancy))])
    return ranks


def place(loads: Sequence[ReplicaLoad], key: str | None, config: RoutingConfig) -> str:
    """The replica for a request no replica has an affinity for yet.

    With a `key` (the adapter, or the prompt's first chunk): rendezvous hashing over the replicas
    within the load guard, so that every router (each ingress replica and batch worker has its
    own) sends the same adapter or prefix to the same replica without talking to the others, and
    a replica joining or leaving moves only its share of keys. Without one: the least-loaded."""
    least = min(r.num_ongoing for r in loads)
    eligible = [
        r
        for r in loads
        if r.kv_occupancy < config.kv_saturation and r.num_ongoing <= least + config.max_imbalance
    ]
    if key is None or not eligible:
        return min(
            loads, key=lambda r: (r.kv_occupancy >= config.kv_saturation, r.num_ongoing, r.kv_occupancy)
        ).replica_id
    return max(
        eligible, key=lambda r: hashlib.blake2b(f"{key}|{r.replica_id}".encode(), digest_size=8).digest()
    ).replica_id


class TandemRouter(RequestRouter):
    """Serve request router of the LLM replicas (`request_router_class`); the policy is
    `rank_replicas`, the state a `PrefixIndex` and the adapters this router placed."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.config = RoutingConfig(**kwargs)
        self.prefix_index = PrefixIndex(self.config.max_index_entries)
        # adapter -> {replica id: when this router last sent it there}
        self.adapter_placements: dict[str, dict[str, float]] = {}
        self.live_replica_ids: set[str] = set()
        # request id -> its prompt digests, from ranking until it is routed (bounded: a request
        # cancelled while waiting is never routed)
        self._pending_digests: OrderedDict[str, list[str]] = OrderedDict()

    def _loads(self, replicas: Sequence[RunningReplica]) -> list[ReplicaLoad]:
        loads = []
        for replica in replicas:
            queued = self.replica_queue_len_cache.get(replica.replica_id)
            stats = replica.routing_stats or {}
            if queued is None:  # no fresh probe: the replica's own last report
                queued = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
            loads.append(
                ReplicaLoad(replica.replica_id.unique_id, queued, float(stats.get("kv_occupancy", 0.0)))
            )
        return loads

    def _adapter_holders(self, lora_name: str, replicas: Sequence[RunningReplica]) -> dict[str, float]:
        placed = self.adapter_placements.get(lora_name, {})
        recent = time.monotonic() - ADAPTER_PLACEMENT_TTL_S
        return {
            r.replica_id.unique_id: 1.0
            for r in replicas
            if lora_name in r.multiplexed_model_ids or placed.get(r.replica_id.unique_id, -1.0) >= recent
        }

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _generation_request(pending_request)
        if request is None:  # not a generate call (stats, lora_info...): any replica
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = self._loads(candidate_replicas)
        digests: list[str] = []
        if request.lora_name is not None:
            affinity = self._adapter_holders(request.lora_name, candidate_replicas)
        else:
            digests, num_units = prefix_hashes(
                request, self.config.prefix_chunk_chars, self.config.max_prefix_chunks
            )
            self._pending_digests[request.request_id] = digests
            while len(self._pending_digests) > MAX_PENDING_DIGESTS:
                self._pending_digests.popitem(last=False)
            matched = self.prefix_index.match(digests)
            affinity = {
                rid: float(n) for rid, n in matched.items() if n / num_units >= self.config.min_match_fraction
            }
        ranks = rank_replicas(loads, affinity, self.config)
        if ranks and not any(affinity.get(rid, 0) > 0 for rid in ranks[0]):
            # No affinity (or the preferred replicas are overloaded): place it now, and remember
            # that, so the rest of a burst follows it.
            key = request.lora_name if request.lora_name is not None else (digests[0] if digests else None)
            chosen = place(loads, key, self.config)
            ranks = [[chosen], *[[rid for rid in rank if rid != chosen] for rank in ranks]]
            self._remember(request, digests, chosen)
        return [[by_id[rid] for rid in rank] for rank in ranks if rank]

    def _remember(self, request: GenerationRequest, digests: list[str], replica_id: str) -> None:
        if request.lora_name is not None:
            self.adapter_placements.setdefault(request.lora_name, {})[replica_id] = time.monotonic()
        elif digests:
            self.prefix_index.record(digests, replica_id)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        request = _generation_request(pending_request)
        if request is None:
            return
        digests = self._pending_digests.pop(request.request_id, None)
        if digests is None and request.lora_name is None:
            digests, _ = prefix_hashes(request, self.config.prefix_chunk_chars, self.config.max_prefix_chunks)
        self._remember(request, digests or [], replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        if live == self.live_replica_ids:
            return
        self.live_replica_ids = live
        self.prefix_index.forget_replicas(live)
        for placements in self.adapter_placements.values():
            for rid in set(placements) - live:
                del placements[rid]


def _generation_request(pending_request: PendingRequest | None) -> GenerationRequest | None:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, GenerationRequest):
            return arg
    return None
