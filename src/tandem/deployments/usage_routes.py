"""`GET /v1/organization/usage/completions`: metered usage in the shape of OpenAI's usage API.

An operator key reads every tenant's usage (`project_ids` filters, `group_by=project_id` splits
by tenant); a tenant's key reads only its own (its tenant is the only project it sees, and naming
another one in `project_ids` is a 403). 404 when the server has no object store (nothing is
metered). The query's parameters and the page's shape: `platform/usage_query.py`.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` annotation after
# Serve ships the routes to the replica by value (as admin_routes.py).

import dataclasses
from collections.abc import Callable

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.errors import NotFoundError
from tandem.platform.tenancy import PermissionDeniedError
from tandem.platform.usage_query import parse_usage_query, usage_page


def usage_router(server_of: Callable[[Request], OpenAIServer]) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/organization/usage/completions")
    async def usage_completions(request: Request) -> dict[str, object]:
        server = server_of(request)
        authorization = request.headers.get("authorization")
        tenant = (
            None if server.tenants.is_operator(authorization) else server.tenants.authenticate(authorization)
        )
        if server.usage_log is None:
            raise NotFoundError("usage is not metered on this server (it has no object store)")
        params = {name: request.query_params.getlist(name) for name in request.query_params}
        query = parse_usage_query(params)
        if tenant is not None:
            if query.project_ids is not None and query.project_ids != {tenant}:
                raise PermissionDeniedError(
                    "a tenant's key reads only its own usage: leave project_ids out or name only your tenant"
                )
            query = dataclasses.replace(query, project_ids=frozenset({tenant}))
        return await run_in_threadpool(usage_page, server.usage_log.store, query)

    return router
