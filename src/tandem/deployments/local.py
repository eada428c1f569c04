"""The platform as `tandem serve` wires it, in one process: the factory tests and benchmarks use
to run the app over an in-process `AsyncEngine` (the OpenAI server with files, batches, adapters
and usage metering on one object store, and a batch worker), instead of each wiring it by hand.
`AsyncEngine` is only a type here: this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from tandem.batch.service import BatchLimits, BatchService
from tandem.batch.worker import BatchWorker
from tandem.deployments.adapters import AdapterStore
from tandem.deployments.batch_execution import execute_batch_line
from tandem.deployments.engine_clients import LocalEngineClient
from tandem.deployments.openai.endpoints import BATCH_ENDPOINTS
from tandem.deployments.openai.response_store import ResponseStore
from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.object_store import ObjectStore
from tandem.platform.tenancy import TenantRegistry
from tandem.platform.usage_log import UsageLog

if TYPE_CHECKING:
    from tandem.engine.async_engine import AsyncEngine


@dataclass
class LocalPlatform:
    """What `local_platform` built: the server the app answers with, and its parts."""

    server: OpenAIServer
    batches: BatchService
    worker: BatchWorker
    adapters: AdapterStore | None
    usage_log: UsageLog | None


def local_platform(
    engine: AsyncEngine,
    store: ObjectStore,
    tenants: TenantRegistry,
    *,
    batch_limits: BatchLimits,
    model: str = "tiny",
    adapters: AdapterStore | bool = False,
    usage_log: UsageLog | None = None,
    worker_id: str = "local",
    poll_interval_s: float = 0.05,
) -> LocalPlatform:
    """The OpenAI server over `engine` with files, batches and a batch worker on `store` (the
    worker is not started); `adapters`: an `AdapterStore` (or True for a plain one on `store`) that
    the engine client loads adapters from; `usage_log`: real-time requests metered there."""
    adapter_store = AdapterStore(store, model) if adapters is True else adapters or None
    batches = BatchService(store, {model}, batch_limits, endpoints=BATCH_ENDPOINTS)
    server = OpenAIServer(
        LocalEngineClient(engine, adapter_store),
        tenants,
        batches=batches,
        adapters=adapter_store,
        usage_log=usage_log,
        response_store=ResponseStore(store),
    )
    worker = BatchWorker(
        batches, partial(execute_batch_line, server), poll_interval_s=poll_interval_s, worker_id=worker_id
    )
    return LocalPlatform(server, batches, worker, adapter_store, usage_log)
