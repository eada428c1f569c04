"""Tenants and their API keys, managed live, in the object store (`TenantDirectory`).

Storage: one JSON document, `tenancy/directory.json`, next to batches and adapters. Every change
is a compare-and-swap on it (`put(if_match=etag)`, retried on a lost race), so concurrent
operators on several ingress replicas never lose each other's writes, and a reader sees either
the old or the new directory, never half of a change. Readers (`refresh`) HEAD the document and
GET it only when its etag changed: every replica sees a change within its refresh interval.

Local copy: with `saved` (platform/local_state.py), every version read is also saved on local disk (mode 0600: key
digests only, as in the store), and `warm_start` serves the saved version when the store cannot
be read, so a process that starts while the store is down still knows the issued keys.

Contract:
- A tenant has an id (letters, digits, '.', '_', '-'; at most 64), `TenantLimitsSpec` (unset:
  the server's defaults) and a fair-share `weight` (> 0, 1 by default).
- A key belongs to one tenant. Only its SHA-256 digest is stored, with an id (`key_...`), a
  display prefix (its first 8 characters), an optional name and expiry; the secret itself is
  returned once, by `create_key`, and never stored or logged. Deleting a tenant revokes its keys.
- Errors are the platform's: `NotFoundError` (404) for an unknown tenant or key,
  `ConflictError` (409) for a duplicate tenant id, `InvalidRequestError` (400, naming the field)
  for a malformed id, limits or weight. A failed call writes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.platform.errors import ConflictError, InvalidRequestError, NotFoundError
from tandem.platform.local_state import SavedDocument
from tandem.platform.object_store import ObjectNotFound, ObjectStore, PreconditionFailed

logger = logging.getLogger("tandem.tenancy")

DIRECTORY_KEY = "tenancy/directory.json"
KEY_PREFIX = "tdm-"  # every issued key starts with it (a leaked one is recognisable)
TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_MAX_CAS_ATTEMPTS = 20
T = TypeVar("T")


class TenantLimitsSpec(BaseModel):
    """Per-tenant limits; None: the server's default for that limit."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_requests: int | None = Field(default=None, ge=1)
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_batch_tokens_queued: int | None = Field(default=None, ge=1)
    max_adapters: int | None = Field(default=None, ge=0)
    max_adapter_bytes: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)


class TenantSpec(BaseModel):
    """A tenant as the operator API takes it (`POST /v1/admin/tenants`)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    limits: TenantLimitsSpec = Field(default_factory=lambda: TenantLimitsSpec())
    weight: float = Field(default=1.0, gt=0.0, le=1000.0)


class TenantPatch(BaseModel):
    """A change to a tenant (`PATCH`): the fields given replace the stored ones; `limits` given
    replaces each limit it names (null clears it back to the default)."""

    model_config = ConfigDict(extra="forbid")

    limits: dict[str, int | None] | None = None
    weight: float | None = Field(default=None, gt=0.0, le=1000.0)


@dataclass(frozen=True)
class Tenant:
    id: str
    limits: TenantLimitsSpec
    weight: float
    created_at: int

    def api(self) -> dict[str, object]:
        return {
            "id": self.id, "object": "organization.tenant", "limits": self.limits.model_dump(),
            "weight": self.weight, "created_at": self.created_at,
        }  # fmt: skip


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant: str
    digest: str  # sha256 of the secret, hex
    prefix: str  # the secret's first characters, for display
    created_at: int
    name: str | None = None
    expires_at: int | None = None

    def api(self) -> dict[str, object]:
        """The key as listed: never its secret or digest."""
        return {
            "id": self.id, "object": "organization.tenant.api_key", "tenant": self.tenant,
            "redacted_value": self.prefix + "...", "name": self.name, "created_at": self.created_at,
            "expires_at": self.expires_at,
        }  # fmt: skip

    def live(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


@dataclass(frozen=True)
class DirectorySnapshot:
    """One version of the directory (immutable; a refresh swaps in a new one)."""

    tenants: dict[str, Tenant] = field(default_factory=dict)
    keys: dict[str, ApiKey] = field(default_factory=dict)  # key id -> key
    etag: str | None = None

    def key_for_digest(self, digest: str, now: float | None = None) -> ApiKey | None:
        """The live key with this digest whose tenant exists, or None."""
        now = time.time() if now is None else now
        for key in self.keys.values():
            if hmac.compare_digest(key.digest, digest) and key.live(now) and key.tenant in self.tenants:
                return key
        return None

    def tenant_for_digest(self, digest: str, now: float | None = None) -> str | None:
        """The tenant of the live key with this digest, or None."""
        key = self.key_for_digest(digest, now)
        return None if key is None else key.tenant


def _to_json(snapshot: DirectorySnapshot) -> bytes:
    return json.dumps(
        {
            "tenants": {
                t.id: {"limits": t.limits.model_dump(), "weight": t.weight, "created_at": t.created_at}
                for t in snapshot.tenants.values()
            },
            "keys": {
                k.id: {
                    "tenant": k.tenant,
                    "digest": k.digest,
                    "prefix": k.prefix,
                    "created_at": k.created_at,
                    "name": k.name,
                    "expires_at": k.expires_at,
                }  # fmt: skip
                for k in snapshot.keys.values()
            },
        },
        sort_keys=True,
    ).encode()


def _from_json(data: bytes, etag: str | None) -> DirectorySnapshot:
    doc = json.loads(data)
    tenants = {
        tid: Tenant(tid, TenantLimitsSpec(**t["limits"]), float(t["weight"]), int(t["created_at"]))
        for tid, t in doc.get("tenants", {}).items()
    }
    keys = {kid: ApiKey(id=kid, **k) for kid, k in doc.get("keys", {}).items()}
    return DirectorySnapshot(tenants, keys, etag)


def _invalid(exc: ValidationError, prefix: str = "") -> InvalidRequestError:
    error = exc.errors()[0]
    param = ".".join(str(part) for part in (prefix, *error["loc"]) if part != "")
    return InvalidRequestError(f"{param}: {error['msg']}", param=param or None)


def parse_tenant_spec(body: Any) -> TenantSpec:
    """An operator's tenant body -> `TenantSpec`, or a 400 naming the field."""
    try:
        spec = TenantSpec.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from exc
    if not TENANT_ID.match(spec.id):
        raise InvalidRequestError(
            "id: letters, digits, '.', '_' and '-' only (starting with a letter or digit), at most 64",
            param="id",
        )
    return spec


def parse_tenant_patch(body: Any) -> TenantPatch:
    try:
        patch = TenantPatch.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from exc
    return patch


class TenantDirectory:
    """Reads and changes the directory in `store` (module docstring). Thread-safe: every change
    is a compare-and-swap of the whole document; `snapshot` is swapped atomically."""

    def __init__(
        self, store: ObjectStore, key: str = DIRECTORY_KEY, *, saved: SavedDocument | None = None
    ) -> None:
        """`saved`: where every version read is kept on local disk (`warm_start` serves it)."""
        self.store = store
        self.key = key
        self.saved = saved
        self._snapshot = DirectorySnapshot()

    def warm_start(self) -> DirectorySnapshot:
        """Read the directory; when the store cannot answer, serve the copy saved on local disk
        (if any: else only the bootstrap keys work until a refresh succeeds). Never raises."""
        try:
            return self.refresh()
        except Exception as exc:  # noqa: BLE001 - a process must start while the store is down
            copy = self.saved.load() if self.saved is not None else None
            logger.warning(
                "tenant directory unreadable at start; serving the copy saved on local disk"
                if copy is not None
                else "tenant directory unreadable at start and no local copy: only bootstrap keys work until it answers",
                extra={"error": f"{type(exc).__name__}: {exc}"[:300]},
            )
            if copy is not None:
                self._snapshot = _from_json(*copy)
            return self._snapshot

    def _swap(self, snapshot: DirectorySnapshot) -> DirectorySnapshot:
        if self.saved is not None and (snapshot.etag != self._snapshot.etag or snapshot.etag is None):
            self.saved.save(_to_json(snapshot), snapshot.etag)
        self._snapshot = snapshot
        return snapshot

    # -- reading ----------------------------------------------------------------------------
    @property
    def snapshot(self) -> DirectorySnapshot:
        """The version read last (`refresh`)."""
        return self._snapshot

    def refresh(self) -> DirectorySnapshot:
        """Read the directory if it changed since the last read (a HEAD, then a GET on change)."""
        etag = self.store.head(self.key)
        if etag is None:
            if self._snapshot.etag is not None or self._snapshot.tenants:
                self._swap(DirectorySnapshot())
        elif etag != self._snapshot.etag:
            self._swap(self._read()[0])
        return self._snapshot

    def adopt(self, snapshot: DirectorySnapshot) -> None:
        """Hold `snapshot`, a version another reader of the same store read (no store call: the
        next `refresh` compares etags as usual)."""
        self._snapshot = snapshot

    def refresh_if_changed(self, etag: str | None) -> DirectorySnapshot:
        """Read the directory only if `etag` (its etag as someone else just saw it: the fleet
        state's) differs from the version held; no store call otherwise."""
        if etag == self._snapshot.etag:
            return self._snapshot
        return self.refresh()

    def _read(self) -> tuple[DirectorySnapshot, str | None]:
        try:
            stored = self.store.get(self.key)
        except ObjectNotFound:
            return DirectorySnapshot(), None
        return _from_json(stored.data, stored.etag), stored.etag

    def _change(self, edit: Callable[[DirectorySnapshot], tuple[DirectorySnapshot, T]]) -> T:
        """Apply `edit(snapshot) -> (new snapshot, result)` by compare-and-swap, retried when
        another writer got there first; returns the result. `edit` raises to refuse (nothing
        is written)."""
        for _ in range(_MAX_CAS_ATTEMPTS):
            current, etag = self._read()
            updated, result = edit(current)
            try:
                if etag is None:
                    new_etag = self.store.put(self.key, _to_json(updated), if_none_match=True)
                else:
                    new_etag = self.store.put(self.key, _to_json(updated), if_match=etag)
            except PreconditionFailed:
                continue
            self._swap(DirectorySnapshot(updated.tenants, updated.keys, new_etag))
            return result
        raise ConflictError("the tenant directory changed under this update too often; retry")

    # -- tenants ----------------------------------------------------------------------------
    def list_tenants(self) -> list[Tenant]:
        return sorted(self._read()[0].tenants.values(), key=lambda t: t.id)

    def get_tenant(self, tenant_id: str) -> Tenant:
        tenant = self._read()[0].tenants.get(tenant_id)
        if tenant is None:
            raise NotFoundError(f"no tenant {tenant_id!r}", param="tenant_id")
        return tenant

    def create_tenant(self, spec: TenantSpec) -> Tenant:
        tenant = Tenant(spec.id, spec.limits, spec.weight, int(time.time()))

        def edit(current: DirectorySnapshot) -> tuple[DirectorySnapshot, Tenant]:
            if spec.id in current.tenants:
                raise ConflictError(f"tenant {spec.id!r} already exists", param="id")
            return DirectorySnapshot({**current.tenants, spec.id: tenant}, current.keys), tenant

        return self._change(edit)

    def update_tenant(self, tenant_id: str, patch: TenantPatch) -> Tenant:
        def edit(current: DirectorySnapshot) -> tuple[DirectorySnapshot, Tenant]:
            old = current.tenants.get(tenant_id)
            if old is None:
                raise NotFoundError(f"no tenant {tenant_id!r}", param="tenant_id")
            limits = old.limits
            if patch.limits is not None:
                try:
                    limits = TenantLimitsSpec.model_validate({**old.limits.model_dump(), **patch.limits})
                except ValidationError as exc:
                    raise _invalid(exc, "limits") from exc
            weight = old.weight if patch.weight is None else patch.weight
            new = Tenant(old.id, limits, weight, old.created_at)
            return DirectorySnapshot({**current.tenants, tenant_id: new}, current.keys), new

        return self._change(edit)

    def delete_tenant(self, tenant_id: str) -> None:
        """Remove the tenant and revoke its keys."""

        def edit(current: DirectorySnapshot) -> tuple[DirectorySnapshot, None]:
            if tenant_id not in current.tenants:
                raise NotFoundError(f"no tenant {tenant_id!r}", param="tenant_id")
            tenants = {tid: t for tid, t in current.tenants.items() if tid != tenant_id}
            keys = {kid: k for kid, k in current.keys.items() if k.tenant != tenant_id}
            return DirectorySnapshot(tenants, keys), None

        self._change(edit)

    # -- keys -------------------------------------------------------------------------------
    def create_key(
        self, tenant_id: str, *, name: str | None = None, expires_at: int | None = None
    ) -> tuple[ApiKey, str]:
        """Issue a key for the tenant: (its record, the secret). The secret exists only in the
        return value."""
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(
            id="key_" + secrets.token_hex(8), tenant=tenant_id, digest=hashlib.sha256(secret.encode()).hexdigest(),
            prefix=secret[:8], created_at=int(time.time()), name=name, expires_at=expires_at,
        )  # fmt: skip
        if expires_at is not None and expires_at <= key.created_at:
            raise InvalidRequestError("expires_at must be in the future (Unix seconds)", param="expires_at")

        def edit(current: DirectorySnapshot) -> tuple[DirectorySnapshot, ApiKey]:
            if tenant_id not in current.tenants:
                raise NotFoundError(f"no tenant {tenant_id!r}", param="tenant_id")
            return DirectorySnapshot(current.tenants, {**current.keys, key.id: key}), key

        return self._change(edit), secret

    def list_keys(self, tenant_id: str) -> list[ApiKey]:
        current = self._read()[0]
        if tenant_id not in current.tenants:
            raise NotFoundError(f"no tenant {tenant_id!r}", param="tenant_id")
        return sorted(
            (k for k in current.keys.values() if k.tenant == tenant_id), key=lambda k: (k.created_at, k.id)
        )

    def revoke_key(self, tenant_id: str, key_id: str) -> None:
        def edit(current: DirectorySnapshot) -> tuple[DirectorySnapshot, None]:
            key = current.keys.get(key_id)
            if key is None or key.tenant != tenant_id:
                raise NotFoundError(f"tenant {tenant_id!r} has no key {key_id!r}", param="key_id")
            return DirectorySnapshot(
                current.tenants, {k: v for k, v in current.keys.items() if k != key_id}
            ), None

        self._change(edit)
