"""Per-tenant LoRA adapters in the object store, and loading them into an engine on demand.

Layout (per tenant `t`, adapter `name`, upload `version`):

    tenants/t/adapters/{name}.json                       AdapterRecord (the current version)
    tenants/t/adapter-data/{name}/{version}/adapter_config.json
    tenants/t/adapter-data/{name}/{version}/adapter_model.safetensors

Requests name an adapter as `model="<base>:<name>"`; the engine knows it as the `lora_id`
`"<tenant>/<name>@<version>"`, so a re-upload under the same name is a different adapter to every
replica (no replica can answer with stale weights), and one tenant's name never resolves to
another tenant's adapter. Replicas load adapters themselves from the store the first time a
request for one arrives (`load_into_engine`; under Serve through `@serve.multiplexed`, so later
requests are routed to replicas that already hold it).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, urlparse

from pydantic import BaseModel

from tandem.batch.records import tenant_prefix
from tandem.engine.lora.checkpoint import LoRALimits, LoRAModelShape, check_peft_adapter
from tandem.platform.errors import ConflictError, InvalidRequestError, NotFoundError
from tandem.platform.object_store import ObjectNotFound, ObjectStore, S3ObjectStore, S3Settings

if TYPE_CHECKING:  # the API processes import no torch (the engine's modules do)
    from tandem.engine.engine import LLMEngine


logger = logging.getLogger("tandem.api")

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # matched whole (fullmatch)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class AdapterRecord(BaseModel):
    name: str
    tenant: str
    version: str
    base_model: str
    created_at: int
    rank: int
    target_modules: list[str]
    bytes: int

    @property
    def lora_id(self) -> str:
        return f"{self.tenant}/{self.name}@{self.version}"

    def api(self) -> dict[str, object]:
        return {
            "id": self.name,
            "object": "adapter",
            "model": f"{self.base_model}:{self.name}",
            "base_model": self.base_model,
            "created_at": self.created_at,
            "rank": self.rank,
            "target_modules": self.target_modules,
            "bytes": self.bytes,
        }


def _record_key(tenant: str, name: str) -> str:
    return f"{tenant_prefix(tenant)}adapters/{name}.json"


def _data_key(tenant: str, name: str, version: str, file: str) -> str:
    return f"{tenant_prefix(tenant)}adapter-data/{name}/{version}/{file}"


def parse_lora_id(lora_id: str) -> tuple[str, str, str]:
    """`tenant/name@version` -> (tenant, name, version)."""
    tenant_and_name, _, version = lora_id.rpartition("@")
    tenant, _, name = tenant_and_name.rpartition("/")
    return tenant, name, version


class AdapterStore:
    """Tenant-scoped adapter records and files. `source_prefixes` lists the folder URIs, each with
    `{tenant}` in it, that an upload may name as `source` instead of sending files: a tenant reads
    only under its own (the server reads them with its own credentials)."""

    def __init__(
        self,
        store: ObjectStore,
        base_model: str,
        *,
        source_prefixes: tuple[str, ...] = (),
        max_adapter_bytes: int = 256 << 20,
        max_adapters_per_tenant: int | None = 64,
        max_adapter_bytes_per_tenant: int | None = 4 << 30,
        s3_settings: S3Settings | None = None,
        tenant_limits: Callable[[str], tuple[int | None, int | None]] | None = None,
    ) -> None:
        """`s3_settings`: how `s3://` sources are read (default: the environment's endpoint and
        credentials, the server's own). A tenant stores at most `max_adapters_per_tenant`
        adapters of `max_adapter_bytes_per_tenant` weight bytes in all (None: no limit); two
        uploads racing past the limit may both land (the check reads the tenant's records).
        `tenant_limits(tenant)`: that tenant's own (max adapters, max bytes), each None where it
        sets none (the tenant directory's limits)."""
        self.store = store
        self.base_model = base_model
        self.source_prefixes = tuple(check_source_prefix(p) for p in source_prefixes)
        self.max_adapter_bytes = max_adapter_bytes
        self.max_adapters_per_tenant = max_adapters_per_tenant
        self.max_adapter_bytes_per_tenant = max_adapter_bytes_per_tenant
        self.s3_settings = s3_settings
        self.tenant_limits = tenant_limits

    def create(
        self,
        tenant: str,
        name: str,
        config: bytes,
        weights: bytes,
        shape: LoRAModelShape,
        max_lora_rank: int,
    ) -> AdapterRecord:
        """Validate (against the base model and limits) and store a new adapter; 409 if the name
        is taken (delete it first)."""
        if not NAME_PATTERN.fullmatch(name):
            raise InvalidRequestError(
                "name must be 1-64 characters of letters, digits, '_', '.', '-' (starting with a letter or digit)",
                param="name",
            )
        if self.store.exists(_record_key(tenant, name)):
            raise ConflictError(f"adapter {name!r} already exists; delete it first", param="name")
        self._check_tenant_room(tenant, len(weights))
        limits = LoRALimits(max_lora_rank=max_lora_rank, max_adapter_bytes=self.max_adapter_bytes)
        adapter = check_peft_adapter(config, weights, shape, limits)
        record = AdapterRecord(
            name=name,
            tenant=tenant,
            version=f"{int(time.time() * 1000):012x}{secrets.token_hex(4)}",
            base_model=self.base_model,
            created_at=int(time.time()),
            rank=adapter.rank,
            target_modules=list(adapter.target_modules),
            bytes=len(weights),
        )
        self.store.put(_data_key(tenant, name, record.version, CONFIG_FILE), config)
        self.store.put(_data_key(tenant, name, record.version, WEIGHTS_FILE), weights)
        self.store.put(_record_key(tenant, name), record.model_dump_json().encode(), if_none_match=True)
        return record

    def _check_tenant_room(self, tenant: str, num_bytes: int) -> None:
        """A 400 naming the limit when one more adapter of `num_bytes` would take `tenant` past
        its adapter count or bytes."""
        own_count, own_bytes = self.tenant_limits(tenant) if self.tenant_limits is not None else (None, None)
        max_count = own_count if own_count is not None else self.max_adapters_per_tenant
        limit = own_bytes if own_bytes is not None else self.max_adapter_bytes_per_tenant
        if max_count is None and limit is None:
            return
        records = self.list(tenant)
        if max_count is not None and len(records) >= max_count:
            raise InvalidRequestError(
                f"tenant {tenant!r} has {len(records)} adapters, the limit (max_adapters_per_tenant = "
                f"{max_count}); delete one first, or ask the operator to raise the limit",
                param="max_adapters_per_tenant",
                code="adapter_limit_reached",
            )
        stored = sum(r.bytes for r in records)
        if limit is not None and stored + num_bytes > limit:
            raise InvalidRequestError(
                f"tenant {tenant!r} stores {stored} adapter bytes; {num_bytes} more would pass the limit "
                f"(max_adapter_bytes_per_tenant = {limit}); delete an adapter first, or ask the operator "
                "to raise the limit",
                param="max_adapter_bytes_per_tenant",
                code="adapter_limit_reached",
            )

    def fetch_source(self, tenant: str, source: str) -> tuple[bytes, bytes]:
        """The two PEFT files of the folder `source`, which must lie under one of `tenant`'s own
        source prefixes (`source_prefixes` with `{tenant}` filled in). Nothing is created, and
        nothing outside those folders is read."""
        folder = resolve_source(
            source, [p.format(tenant=quote(tenant, safe="")) for p in self.source_prefixes]
        )
        try:
            if isinstance(folder, Path):
                return _read_inside(folder, CONFIG_FILE), _read_inside(folder, WEIGHTS_FILE)
            bucket, key_prefix = folder
            store = S3ObjectStore(bucket, key_prefix, self.s3_settings)
            return store.get(CONFIG_FILE).data, store.get(WEIGHTS_FILE).data
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ObjectNotFound) as exc:
            raise NotFoundError(
                f"{source} must hold {CONFIG_FILE} and {WEIGHTS_FILE}", param="source"
            ) from exc
        except Exception as exc:  # permissions, credentials, the network: the caller cannot fix those
            logger.warning("adapter source unreadable", extra={"tenant": tenant, "error": repr(exc)[:300]})
            raise InvalidRequestError(
                f"{source} could not be read; upload the files instead",
                param="source",
                code="source_unreadable",
            ) from exc

    def get(self, tenant: str, name: str) -> AdapterRecord:
        if not NAME_PATTERN.fullmatch(name):  # no such adapter can exist (and the key stays safe)
            raise NotFoundError(
                f"The model '{self.base_model}:{name}' does not exist", param="model", code="model_not_found"
            )
        try:
            return AdapterRecord.model_validate_json(self.store.get(_record_key(tenant, name)).data)
        except (ObjectNotFound, ValueError) as exc:
            raise NotFoundError(
                f"The model '{self.base_model}:{name}' does not exist", param="model", code="model_not_found"
            ) from exc

    def list(self, tenant: str) -> list[AdapterRecord]:
        keys = self.store.list(f"{tenant_prefix(tenant)}adapters/")
        return [self.get(tenant, k.rsplit("/", 1)[1].removesuffix(".json")) for k in keys]

    def delete(self, tenant: str, name: str) -> None:
        record = self.get(tenant, name)
        self.store.delete(_record_key(tenant, name))
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            self.store.delete(_data_key(tenant, name, record.version, file))

    def read(self, lora_id: str) -> tuple[bytes, bytes]:
        """The files of one adapter version (what a replica loads)."""
        tenant, name, version = parse_lora_id(lora_id)
        try:
            return (
                self.store.get(_data_key(tenant, name, version, CONFIG_FILE)).data,
                self.store.get(_data_key(tenant, name, version, WEIGHTS_FILE)).data,
            )
        except ObjectNotFound as exc:
            raise NotFoundError(
                f"adapter {name!r} was deleted", param="model", code="model_not_found"
            ) from exc


def _read_inside(folder: Path, name: str) -> bytes:
    """`folder/name`, unless it is a link to somewhere outside `folder`."""
    path = Path(os.path.realpath(folder / name))
    if path.parent != folder:
        raise FileNotFoundError(name)
    return path.read_bytes()


def check_source_prefix(prefix: str) -> str:
    """An operator's adapter source prefix: an `s3://bucket/...` or `file:///...` folder with
    `{tenant}` as one whole path segment (so each tenant gets a folder of its own)."""
    parsed = urlparse(prefix)
    segments = parsed.path.split("/")
    if (
        parsed.scheme not in ("s3", "file")
        or (parsed.scheme == "s3" and not parsed.netloc)
        or (parsed.scheme == "file" and parsed.netloc not in ("", "localhost"))
        or "{tenant}" not in segments
        or prefix.count("{") != 1
        or prefix.count("}") != 1
        or any(part in (".", "..") for part in segments)
    ):
        raise ValueError(
            f"adapter source prefix {prefix!r} must be s3://bucket/.../{{tenant}}/... or "
            "file:///.../{tenant}/..., with {tenant} as a whole path segment"
        )
    return prefix


def resolve_source(source: str, allowed: list[str]) -> Path | tuple[str, str]:
    """The local folder (`Path`) or the (bucket, key prefix) that `source` names, if it lies under
    one of the `allowed` folder URIs; `InvalidRequestError` otherwise (traversal, another scheme,
    query strings, a symlink out of the folder)."""
    parsed = urlparse(source)
    segments = parsed.path.split("/")
    if (
        not allowed
        or parsed.scheme not in ("s3", "file")
        or parsed.query
        or parsed.fragment
        or parsed.params
        or any(part in (".", "..") for part in segments)
        or "%" in parsed.path  # no percent-encoding: what is checked is what is read
        or "\x00" in source
        or "\\" in source
    ):
        shown = allowed or "none: upload the files instead"
        raise InvalidRequestError(
            f"source is not allowed here (allowed folders for you: {shown})", param="source"
        )
    for prefix in allowed:
        base = urlparse(prefix.rstrip("/") + "/")
        if parsed.scheme != base.scheme or parsed.netloc != base.netloc:
            continue
        path = parsed.path.rstrip("/") + "/"
        if not path.startswith(base.path):
            continue
        if parsed.scheme == "s3":
            return parsed.netloc, parsed.path.strip("/")
        root = Path(os.path.realpath(base.path))
        folder = Path(os.path.realpath(parsed.path))
        if folder == root or root in folder.parents:
            return folder
    raise InvalidRequestError(
        f"source is not allowed here (allowed folders for you: {allowed})", param="source"
    )


def load_into_engine(engine: LLMEngine, adapters: AdapterStore, lora_id: str) -> None:
    """Fetch `lora_id` from the store and register it with `engine`."""
    if not engine.adapters.enabled:
        raise InvalidRequestError("this replica serves no LoRA adapters (enable_lora is off)", param="model")
    if engine.adapters.has(lora_id):
        return
    config, weights = adapters.read(lora_id)
    engine.adapters.add_checkpoint(lora_id, config, weights)
