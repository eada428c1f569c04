"""OpenAI files + batches routes (`/v1/files`, `/v1/batches`), tenant-scoped.

The routes only authenticate, parse and shape; `BatchService` does the work (in a thread, since
the object store client is blocking). Every lookup is under the caller's tenant, so another
tenant's ids answer 404 exactly like ids that never existed.
"""

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool

from tandem.batch.service import BatchService
from tandem.deployments.openai.errors import validation_error_body
from tandem.deployments.openai.requests import Text
from tandem.deployments.openai.server import OpenAIServer
from tandem.deployments.uploads import json_request_body, reject_declared_oversize
from tandem.platform.errors import InvalidRequestError, NotFoundError


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: Text
    endpoint: Text
    completion_window: Text
    metadata: dict[Text, Text] | None = None


def _list(records: list[Any], has_more: bool) -> dict[str, Any]:
    data = [r.api() for r in records]
    return {
        "object": "list",
        "data": data,
        "has_more": has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise InvalidRequestError(f"{name} must be an integer", param=name) from exc


async def _read_upload(request: Request, service: BatchService) -> tuple[str, str, bytes]:
    """A `/v1/files` upload's file name, purpose and bytes (multipart), within the size limit."""
    reject_declared_oversize(request, service.limits.max_file_bytes, "file")
    form = await request.form(max_part_size=service.limits.max_file_bytes + 1)
    upload, purpose = form.get("file"), form.get("purpose")
    if upload is None or isinstance(upload, str):
        raise InvalidRequestError("a multipart field 'file' with the JSONL file is required", param="file")
    if not isinstance(purpose, str):
        raise InvalidRequestError("a multipart field 'purpose' is required (use 'batch')", param="purpose")
    data = await upload.read(service.limits.max_file_bytes + 1)
    service.check_file_size(len(data))
    return upload.filename or "upload.jsonl", purpose, data


def batch_router(
    authenticated: Callable[[Request], tuple[OpenAIServer, str]],
    json_body: Callable[[Request], Awaitable[dict[str, Any]]],
) -> APIRouter:
    router = APIRouter()

    def service_and_tenant(request: Request) -> tuple[BatchService, str]:
        server, tenant = authenticated(request)
        if server.batches is None:
            raise NotFoundError("the files and batches API is not enabled on this server (no object store)")
        return server.batches, tenant

    @router.post("/v1/files")
    async def create_file(request: Request) -> dict[str, object]:
        service, tenant = service_and_tenant(request)
        filename, purpose, data = await _read_upload(request, service)
        record = await run_in_threadpool(service.create_file, tenant, filename, purpose, data)
        return record.api()

    @router.get("/v1/files")
    async def list_files(request: Request) -> dict[str, object]:
        service, tenant = service_and_tenant(request)
        records, has_more = await run_in_threadpool(
            service.list_files,
            tenant,
            purpose=request.query_params.get("purpose"),
            after=request.query_params.get("after"),
            limit=_int_param(request, "limit", 100),
            order=request.query_params.get("order", "desc"),
        )
        return _list(records, has_more)

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request) -> dict[str, object]:
        service, tenant = service_and_tenant(request)
        return (await run_in_threadpool(service.get_file, tenant, file_id)).api()

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> Response:
        service, tenant = service_and_tenant(request)
        data = await run_in_threadpool(service.file_content, tenant, file_id)
        return Response(data, media_type="application/octet-stream")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> dict[str, object]:
        service, tenant = service_and_tenant(request)
        await run_in_threadpool(service.delete_file, tenant, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    _batch_routes(router, authenticated, service_and_tenant, json_body)
    return router


def _batch_routes(
    router: APIRouter,
    authenticated: Callable[[Request], tuple[OpenAIServer, str]],
    service_and_tenant: Callable[[Request], tuple[BatchService, str]],
    json_body: Callable[[Request], Awaitable[dict[str, Any]]],
) -> None:
    """`/v1/batches`: create (validated like OpenAI's), list, get, cancel."""

    @router.post("/v1/batches", openapi_extra=json_request_body(BatchCreateRequest.model_json_schema()))
    async def create_batch(request: Request) -> dict[str, object]:
        service, tenant = service_and_tenant(request)
        body = await json_body(request)
        for name in ("output_expires_after",):
            if body.get(name) is not None:
                raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)
            body.pop(name, None)
        try:
            req = BatchCreateRequest.model_validate(body)
        except ValidationError as exc:
            error = validation_error_body(exc.errors())["error"]
            raise InvalidRequestError(str(error["message"]), param=error["param"]) from exc
        server, _ = authenticated(request)
        caller = server.tenants.identify(request.headers.get("authorization"))
        record = await run_in_threadpool(
            service.create_batch, tenant, req.input_file_id, req.endpoint, req.completion_window, req.metadata,
            server.tenants.max_batch_tokens_queued_for(tenant), caller.api_key_id,
        )  # fmt: skip
        if server.on_batch_created is not None and record.status == "in_progress":
            server.on_batch_created()
        return record.api()

    @router.get("/v1/batches")
    async def list_batches(request: Request) -> dict[str, object]:
        service, tenant = service_and_tenant(request)
        records, has_more = await run_in_threadpool(
            service.list_batches,
            tenant,
            after=request.query_params.get("after"),
            limit=_int_param(request, "limit", 20),
        )
        return _list(records, has_more)

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request) -> dict[str, object]:
        service, tenant = service_and_tenant(request)
        return (await run_in_threadpool(service.get_batch, tenant, batch_id)).api()

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request) -> dict[str, object]:
        service, tenant = service_and_tenant(request)
        return (await run_in_threadpool(service.cancel_batch, tenant, batch_id)).api()
