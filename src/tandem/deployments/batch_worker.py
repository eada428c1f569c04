"""`BatchWorkerReplica`: the Serve deployment that runs batch shards against the LLM replicas.

Each replica runs one `BatchWorker` loop in its event loop. Requests go to the `LLMReplica`
deployment through the same `OpenAIServer` code as real-time traffic, at `priority=batch`, so the
engine admits them only into idle capacity. The deployment autoscales on queued shards
(`BatchQueuePolicy`); a killed replica's leases expire and its shards run elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from functools import partial
from typing import Any

from ray.serve.handle import DeploymentHandle

from tandem.batch.service import BatchLimits, BatchService
from tandem.batch.worker import BatchWorker
from tandem.deployments.adapters import AdapterStore
from tandem.deployments.batch_execution import execute_batch_line
from tandem.deployments.engine_clients import HandleEngineClient
from tandem.deployments.fleet import FleetView, watch_drain
from tandem.deployments.openai.endpoints import BATCH_ENDPOINTS
from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.errors import TandemError
from tandem.platform.local_state import SavedDocument, state_path
from tandem.platform.store_guard import open_object_store
from tandem.platform.tenancy import TenantRegistry
from tandem.platform.tenant_directory import TenantDirectory


class BatchWorkerReplica:
    def __init__(
        self,
        llm: DeploymentHandle,
        object_store: str,
        model_name: str,
        limits: dict[str, Any],
        poll_interval_s: float = 1.0,
        max_tokens_default: int = 256,
        fleet: DeploymentHandle | None = None,
        batch_seats_per_replica: int | None = None,
        tenant_weights: dict[str, float] | None = None,
        tenant_refresh_s: float = 1.0,
    ) -> None:
        store = open_object_store(object_store)
        service = BatchService(store, {model_name}, BatchLimits(**limits), endpoints=BATCH_ENDPOINTS)
        # Lines may name the batch owner's adapters ("base:adapter"), resolved in the same store
        # the ingress uploads them to; the LLM replicas load them as for real-time requests.
        # The live tenant directory: each tenant's weight for shard turns, and its limits and
        # weight on the batch lines it sends the LLM replicas (as the ingress does).
        directory = TenantDirectory(store, saved=SavedDocument(state_path("tenancy", store.url, ".json")))
        directory.warm_start()  # with the store down: the copy saved on this machine
        tenants = TenantRegistry({}, directory=directory)
        tenants.start_refresh(tenant_refresh_s)
        server = OpenAIServer(
            HandleEngineClient(llm, model_name),
            tenants,
            max_tokens_default=max_tokens_default,
            adapters=AdapterStore(store, model_name),
        )
        self.worker = BatchWorker(
            service, partial(execute_batch_line, server), poll_interval_s=poll_interval_s, tenant_weights=tenant_weights,
            weight_of=tenants.weight_for,
        )  # fmt: skip
        self._task = asyncio.get_event_loop().create_task(self.worker.run_forever())
        # A graceful stop: on the fleet's drain, the worker stops claiming and releases the
        # leases of its shards in flight, so another worker resumes them at once.
        self._drain_watch = (
            asyncio.get_event_loop().create_task(
                watch_drain(
                    fleet,
                    lambda: self.worker.num_shards_in_flight,
                    lambda _: self.worker.stop(),
                    lambda view: self._view_seen(tenants, view),
                )
            )
            if fleet is not None
            else None
        )
        # What bounds useful workers: the LLM replicas (as the fleet state knows them) times the
        # batch requests each takes, over the lines one worker keeps out.
        self.fleet = fleet
        self.batch_seats_per_replica = batch_seats_per_replica
        self.lines_per_worker = service.limits.max_shards_in_flight * service.limits.shard_size
        self._queued_shards = 0.0

    def _view_seen(self, tenants: TenantRegistry, view: FleetView) -> None:
        """The fleet state's reading of the store: the directory's version, the queue's length."""
        tenants.directory_seen(view.directory_etag)
        self.worker.queue_seen(view.num_queued_batches)

    async def wake(self) -> None:
        """Look at the queue now instead of at the next poll (the ingress calls this on create)."""
        self.worker.wake()

    async def stats(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker.worker_id,
            "pid": os.getpid(),
            "num_shards_run": self.worker.num_shards_run,
            "num_duplicate_commits": self.worker.num_duplicate_commits,
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        with contextlib.suppress(TandemError):  # the store is down: the last count stands
            self._queued_shards = float(await asyncio.to_thread(self.worker.queued_shards))
        stats = {"queued_shards": self._queued_shards}
        if self.fleet is not None and self.batch_seats_per_replica is not None:
            num_replicas = len(await self.fleet.snapshot.remote())
            stats["workers_for_seats"] = num_replicas * self.batch_seats_per_replica / self.lines_per_worker
        return stats

    async def check_health(self) -> None:
        if self._task.done():
            raise RuntimeError(f"batch worker loop stopped: {self._task.exception()!r}")
