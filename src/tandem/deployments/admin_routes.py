"""The operator API for tenants and keys (`/v1/admin/tenants`), operator keys only.

Routes (the tenant directory, `platform/tenant_directory.py`, does the work; every change is one
compare-and-swap of the directory in the object store, seen by every replica within
`AppConfig.tenant_refresh_s`):

    POST   /v1/admin/tenants                         {"id", "limits"?, "weight"?} -> the tenant
    GET    /v1/admin/tenants                         {"object": "list", "data": [tenants]}
    GET    /v1/admin/tenants/{id}                    the tenant
    PATCH  /v1/admin/tenants/{id}                    {"limits"?, "weight"?} -> the tenant
    DELETE /v1/admin/tenants/{id}                    its keys are revoked with it
    POST   /v1/admin/tenants/{id}/keys               {"name"?, "expires_at"?} -> the key, with
                                                     its secret in "key" (shown only here)
    GET    /v1/admin/tenants/{id}/keys               {"object": "list", "data": [keys]} (no secrets)
    DELETE /v1/admin/tenants/{id}/keys/{key_id}      revoke


401 without a key, 403 with a tenant's key, 404 for an unknown tenant or key (or when the server
has no object store), 409 for a duplicate tenant, 400 naming the field for a malformed body.

A tenant manages its own keys under the project routes of OpenAI's admin API (a project is a
tenant here, as in the usage API); an operator key may manage any tenant's there too:

    GET    /v1/organization/projects/{id}/api_keys            {"object": "list", "data": [keys]}
    POST   /v1/organization/projects/{id}/api_keys            as POST /v1/admin/tenants/{id}/keys
    DELETE /v1/organization/projects/{id}/api_keys/{key_id}   revoke

A tenant's key naming another project is a 403.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` annotation after
# Serve pickles the app (string annotations lose their module globals on the way).

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.errors import InvalidRequestError, NotFoundError
from tandem.platform.tenancy import PermissionDeniedError
from tandem.platform.tenant_directory import TenantDirectory, parse_tenant_patch, parse_tenant_spec


def admin_router(
    server_of: Callable[[Request], OpenAIServer],
    json_body: Callable[[Request], Awaitable[dict[str, object]]],
) -> APIRouter:
    router = APIRouter()

    def directory_for(request: Request) -> TenantDirectory:
        server = server_of(request)
        server.tenants.authenticate_operator(request.headers.get("authorization"))
        if server.tenants.directory is None:
            raise NotFoundError("the tenant admin API needs an object store (AppConfig.object_store)")
        return server.tenants.directory

    @router.post("/v1/admin/tenants")
    async def create_tenant(request: Request) -> dict[str, object]:
        directory = directory_for(request)
        spec = parse_tenant_spec(await json_body(request))
        return (await run_in_threadpool(directory.create_tenant, spec)).api()

    @router.get("/v1/admin/tenants")
    async def list_tenants(request: Request) -> dict[str, object]:
        directory = directory_for(request)
        tenants = await run_in_threadpool(directory.list_tenants)
        return {"object": "list", "data": [t.api() for t in tenants]}

    @router.get("/v1/admin/tenants/{tenant_id}")
    async def get_tenant(tenant_id: str, request: Request) -> dict[str, object]:
        directory = directory_for(request)
        return (await run_in_threadpool(directory.get_tenant, tenant_id)).api()

    @router.patch("/v1/admin/tenants/{tenant_id}")
    async def update_tenant(tenant_id: str, request: Request) -> dict[str, object]:
        directory = directory_for(request)
        patch = parse_tenant_patch(await json_body(request))
        return (await run_in_threadpool(directory.update_tenant, tenant_id, patch)).api()

    @router.delete("/v1/admin/tenants/{tenant_id}")
    async def delete_tenant(tenant_id: str, request: Request) -> dict[str, object]:
        directory = directory_for(request)
        await run_in_threadpool(directory.delete_tenant, tenant_id)
        return {"id": tenant_id, "object": "organization.tenant.deleted", "deleted": True}

    _tenant_key_routes(router, directory_for, json_body)
    _project_key_routes(router, server_of, json_body)
    return router


def _tenant_key_routes(
    router: APIRouter,
    directory_for: Callable[[Request], TenantDirectory],
    json_body: Callable[[Request], Awaitable[dict[str, object]]],
) -> None:
    """A tenant's API keys, for operators."""

    @router.post("/v1/admin/tenants/{tenant_id}/keys")
    async def create_key(tenant_id: str, request: Request) -> dict[str, object]:
        directory = directory_for(request)
        return await _create_key(directory, tenant_id, request, json_body)

    @router.get("/v1/admin/tenants/{tenant_id}/keys")
    async def list_keys(tenant_id: str, request: Request) -> dict[str, object]:
        directory = directory_for(request)
        keys = await run_in_threadpool(directory.list_keys, tenant_id)
        return {"object": "list", "data": [k.api() for k in keys]}

    @router.delete("/v1/admin/tenants/{tenant_id}/keys/{key_id}")
    async def revoke_key(tenant_id: str, key_id: str, request: Request) -> dict[str, object]:
        directory = directory_for(request)
        await run_in_threadpool(directory.revoke_key, tenant_id, key_id)
        return {"id": key_id, "object": "organization.tenant.api_key.deleted", "deleted": True}


def _project_key_routes(
    router: APIRouter,
    server_of: Callable[[Request], OpenAIServer],
    json_body: Callable[[Request], Awaitable[dict[str, object]]],
) -> None:
    """OpenAI's project API keys: an operator, or the tenant (project) itself."""

    def project_directory(request: Request, project_id: str) -> TenantDirectory:
        """The directory, for an operator or for the tenant `project_id` itself (403 for another)."""
        server = server_of(request)
        authorization = request.headers.get("authorization")
        if not server.tenants.is_operator(authorization):
            tenant = server.tenants.authenticate(authorization)
            if tenant != project_id:
                raise PermissionDeniedError("a tenant's key manages only its own project's keys")
        if server.tenants.directory is None:
            raise NotFoundError("API keys are managed only with an object store (AppConfig.object_store)")
        return server.tenants.directory

    @router.get("/v1/organization/projects/{project_id}/api_keys")
    async def list_project_keys(project_id: str, request: Request) -> dict[str, object]:
        directory = project_directory(request, project_id)
        keys = await run_in_threadpool(directory.list_keys, project_id)
        return {"object": "list", "data": [k.api() for k in keys]}

    @router.post("/v1/organization/projects/{project_id}/api_keys")
    async def create_project_key(project_id: str, request: Request) -> dict[str, object]:
        directory = project_directory(request, project_id)
        return await _create_key(directory, project_id, request, json_body)

    @router.delete("/v1/organization/projects/{project_id}/api_keys/{key_id}")
    async def revoke_project_key(project_id: str, key_id: str, request: Request) -> dict[str, object]:
        directory = project_directory(request, project_id)
        await run_in_threadpool(directory.revoke_key, project_id, key_id)
        return {"id": key_id, "object": "organization.project.api_key.deleted", "deleted": True}


async def _create_key(
    directory: TenantDirectory,
    tenant_id: str,
    request: Request,
    json_body: Callable[[Request], Awaitable[dict[str, object]]],
) -> dict[str, object]:
    body = await json_body(request) if await request.body() else {}
    name, expires_at = body.get("name"), body.get("expires_at")
    unknown = sorted(set(body) - {"name", "expires_at"})
    if unknown:
        raise InvalidRequestError(f"unknown field {unknown[0]!r}", param=unknown[0])
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError("name must be a string", param="name")
    if expires_at is not None and (not isinstance(expires_at, int) or isinstance(expires_at, bool)):
        raise InvalidRequestError("expires_at must be Unix seconds (an integer)", param="expires_at")
    key, secret = await run_in_threadpool(
        lambda: directory.create_key(tenant_id, name=name, expires_at=expires_at)
    )
    return {**key.api(), "key": secret}
