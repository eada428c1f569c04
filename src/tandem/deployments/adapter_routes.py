"""LoRA adapter routes (`/v1/adapters`), tenant-scoped.

`POST /v1/adapters` takes a multipart form with `name` and either the two PEFT files
(`adapter_config`: adapter_config.json, `adapter_model`: adapter_model.safetensors) or a `source`
folder URI (`s3://...` or `file://...`, only under the caller's own folder of the operator's
`adapter_source_prefixes`; none by default); a JSON body `{"name", "source"}` works too. The
adapter is validated against the served base model (shapes, rank limit, supported modules) and
numerically (finite weights, bounded scaling and update norm) before it is stored; nothing is loaded into any replica until a
request names it (`model="<base>:<name>"`).
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` annotation after
# Serve pickles the app (string annotations lose their module globals on the way).

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from tandem.deployments.adapters import AdapterStore
from tandem.deployments.openai.requests import require_unicode
from tandem.deployments.openai.server import OpenAIServer
from tandem.deployments.uploads import json_request_body, reject_declared_oversize
from tandem.engine.lora.checkpoint import LoRAModelShape
from tandem.platform.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError

# The JSON form of an upload (the multipart form with the two files is the other).
_SOURCE_BODY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "source": {"type": "string"}},
    "required": ["name", "source"],
}


async def _read_adapter_upload(
    request: Request, json_body: Callable[[Request], Awaitable[dict[str, Any]]], limit: int
) -> tuple[object, object, bytes | None, bytes | None]:
    """An adapter upload's name, source and files: a JSON body (`name`, `source`) or a multipart
    form (`name` and the two files `adapter_config` and `adapter_model`, or `source`)."""
    if request.headers.get("content-type", "").startswith("application/json"):
        body = await json_body(request)
        name, source, config, weights = body.get("name"), body.get("source"), None, None
    else:
        form = await request.form(max_part_size=limit + 1)
        name, source = form.get("name"), form.get("source")
        config_part, weights_part = form.get("adapter_config"), form.get("adapter_model")
        config = None if config_part is None or isinstance(config_part, str) else await config_part.read()
        weights = (
            None
            if weights_part is None or isinstance(weights_part, str)
            else await weights_part.read(limit + 1)
        )
    return name, source, config, weights


def _engine_shape(info: dict[str, object]) -> tuple[LoRAModelShape, int]:
    """The base model's shape and the engine's rank limit from `EngineAdapters.info`."""
    fields, max_lora_rank = info["shape"], info["max_lora_rank"]
    assert isinstance(fields, dict) and isinstance(max_lora_rank, int), "EngineAdapters.info's shape"
    return LoRAModelShape(**{**fields, "target_modules": tuple(fields["target_modules"])}), max_lora_rank


def _store_and_tenant(server: OpenAIServer, tenant: str) -> tuple[OpenAIServer, AdapterStore, str]:
    if server.adapters is None:
        raise NotFoundError("the adapters API is not enabled on this server (no object store)")
    return server, server.adapters, tenant


def adapter_router(
    authenticated: Callable[[Request], tuple[OpenAIServer, str]],
    json_body: Callable[[Request], Awaitable[dict[str, Any]]],
) -> APIRouter:
    router = APIRouter()

    def store_and_tenant(request: Request) -> tuple[OpenAIServer, AdapterStore, str]:
        return _store_and_tenant(*authenticated(request))

    @router.post("/v1/adapters", openapi_extra=json_request_body(_SOURCE_BODY))
    async def create_adapter(request: Request) -> dict[str, object]:
        server, store, tenant = store_and_tenant(request)
        info = await server.lora_info()
        if not info.get("enabled"):
            raise InvalidRequestError("the replicas serve no LoRA adapters (engine enable_lora is off)")
        limit = store.max_adapter_bytes
        reject_declared_oversize(request, limit, "adapter_model")
        name, source, config, weights = await _read_adapter_upload(request, json_body, limit)
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("a 'name' field is required", param="name")
        require_unicode(name, "name")
        if isinstance(source, str) and source:
            require_unicode(source, "source")
            if config is not None or weights is not None:
                raise InvalidRequestError("send either the two files or 'source', not both", param="source")
            config, weights = await run_in_threadpool(store.fetch_source, tenant, source)
        if config is None or weights is None:
            raise InvalidRequestError(
                "send file fields 'adapter_config' (adapter_config.json) and 'adapter_model' "
                "(adapter_model.safetensors), or a 'source' URI",
                param="adapter_model" if config is not None else "adapter_config",
            )
        if len(weights) > limit:
            raise PayloadTooLargeError(
                f"adapter_model is {len(weights)} bytes; the limit is {limit}", param="adapter_model"
            )
        shape, max_lora_rank = _engine_shape(info)
        record = await run_in_threadpool(store.create, tenant, name, config, weights, shape, max_lora_rank)
        return record.api()

    @router.get("/v1/adapters")
    async def list_adapters(request: Request) -> dict[str, object]:
        _, store, tenant = store_and_tenant(request)
        records = await run_in_threadpool(store.list, tenant)
        return {"object": "list", "data": [r.api() for r in records]}

    @router.get("/v1/adapters/{name}")
    async def get_adapter(name: str, request: Request) -> dict[str, object]:
        _, store, tenant = store_and_tenant(request)
        return (await run_in_threadpool(store.get, tenant, name)).api()

    @router.delete("/v1/adapters/{name}")
    async def delete_adapter(name: str, request: Request) -> dict[str, object]:
        _, store, tenant = store_and_tenant(request)
        await run_in_threadpool(store.delete, tenant, name)
        return {"id": name, "object": "adapter", "deleted": True}

    return router
