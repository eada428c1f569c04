"""The operator's views of the fleet (`/v1/admin/fleet`, `/load`, `/batches`), operator keys only.

    GET /v1/admin/fleet     every engine replica's latest stats (as they report them to the fleet
                            state), and `scaling`: the last hour's samples of the replicas
                            reporting against the autoscaling policy's target
    GET /v1/admin/load      per tenant: requests running and waiting in the engines (the replicas'
                            latest reports, summed) and its tenant-limit 429s of the last hour by code
    GET /v1/admin/batches   the batch queue: every unfinished batch with its tenant, and per tenant
                            its batches, lines left and output tokens queued

401 without a key, 403 with a tenant's key; `/batches` is a 404 without an object store. The
console's operator pages read these (console_routes.py); so can any client.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` annotation after
# Serve ships the routes to the replica by value (as admin_routes.py).

import math
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from tandem.batch.service import BatchService
from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.errors import NotFoundError


def _finite(value: Any) -> Any:
    """`value` with every non-finite float (a speculation arm never measured: inf) as None, which
    JSON can carry."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _batch_queue(service: BatchService) -> dict[str, object]:
    """`/v1/admin/batches`' body: the queued batches, oldest first, and per tenant its batches,
    lines left and output tokens queued."""
    data: list[dict[str, object]] = []
    per_tenant: dict[str, dict[str, int]] = {}
    for tenant, batch_id in service.queued_batches():
        try:
            record = service.get_batch(tenant, batch_id)
        except NotFoundError:
            continue  # finished and cleaned up since the queue was listed
        body = record.api()
        lines_left = record.num_lines_left()
        queued = record.num_output_tokens_queued
        data.append({**body, "tenant": tenant, "output_tokens_queued": queued})
        summary = per_tenant.setdefault(tenant, {"batches": 0, "lines_left": 0, "output_tokens_queued": 0})
        summary["batches"] += 1
        summary["lines_left"] += lines_left
        summary["output_tokens_queued"] += queued
    return {"object": "list", "data": data, "tenants": per_tenant}


def operator_router(server_of: Callable[[Request], OpenAIServer]) -> APIRouter:
    router = APIRouter()

    def operator_server(request: Request) -> OpenAIServer:
        """The server, for an operator's key (401 without a key, 403 with a tenant's)."""
        server = server_of(request)
        server.tenants.authenticate_operator(request.headers.get("authorization"))
        return server

    @router.get("/v1/admin/fleet")
    async def fleet(request: Request) -> dict[str, object]:
        """Every engine replica's latest stats (as `/metrics` reads them), by replica id, and the
        last hour's autoscaling samples (replicas reporting against the policy's target)."""
        server = operator_server(request)
        replicas = await server.client.replica_stats()
        scaling = await server.client.scaling_history()
        return {
            "object": "fleet",
            "model": server.model_name,
            "replicas": _finite(replicas),
            "scaling": scaling,
        }

    @router.get("/v1/admin/load")
    async def load(request: Request) -> dict[str, object]:
        """Per tenant: its requests running and waiting in the engines (the replicas' latest
        reports, summed) and its requests refused by its limits (429) in the last hour, by code."""
        server = operator_server(request)
        replicas = await server.client.replica_stats()
        refusals = await server.limiter.refusals()
        tenants: dict[str, dict[str, Any]] = {}

        def entry(tenant: str) -> dict[str, Any]:
            return tenants.setdefault(tenant, {"running": 0, "waiting": 0, "refused_last_hour": {}})

        for stats in replicas.values():
            by_tenant = stats.get("requests_by_tenant")
            for tenant, counts in (by_tenant if isinstance(by_tenant, dict) else {}).items():
                entry(tenant)["running"] += counts.get("running", 0)
                entry(tenant)["waiting"] += counts.get("waiting", 0)
        for tenant, by_code in refusals.items():
            entry(tenant)["refused_last_hour"] = by_code
        return {"object": "tenant_load", "num_replicas": len(replicas), "tenants": tenants}

    @router.get("/v1/admin/batches")
    async def batch_queue(request: Request) -> dict[str, object]:
        """Every batch not yet final, oldest first, with its tenant and the output tokens it may
        still generate; and per tenant, its batches, lines left and tokens queued."""
        server = operator_server(request)
        service = server.batches
        if service is None:
            raise NotFoundError("the batch API is not enabled on this server (no object store)")

        return await run_in_threadpool(_batch_queue, service)

    return router
