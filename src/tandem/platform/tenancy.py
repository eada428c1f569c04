"""API keys -> tenants, stored hashed; per-tenant concurrency and tokens-per-minute limits.

Keys come from `TANDEM_API_KEYS` ("key1=tenant1,key2=tenant2") or a keys file with one
`key=tenant` per line (the bootstrap), and, with an object store, from the live tenant directory
(`tenant_directory.py`), which the operator API changes and every replica re-reads every
`interval_s` of `TenantRegistry.start_refresh` (`AppConfig.tenant_refresh_s`). Only SHA-256 digests of keys are kept, in memory and in the store.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tandem.platform.api_keys import (
    AuthenticationError,
    bearer_digest,
    bootstrap_key_id,
    env_api_keys,
    hash_key,
    parse_keys,
)
from tandem.platform.errors import TandemError
from tandem.platform.tenant_directory import Tenant, TenantDirectory

logger = logging.getLogger("tandem.tenancy")


class PermissionDeniedError(TandemError):
    status_code = 403
    error_type = "permission_denied_error"


class RateLimitError(TandemError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float, code: str = "rate_limit_exceeded") -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class TenantLimits:
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None

    @property
    def enforced(self) -> bool:
        """Whether any of these limits is set (else admission needs no bookkeeping)."""
        return any(
            v is not None
            for v in (self.max_concurrent_requests, self.tokens_per_minute, self.requests_per_minute)
        )


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant and the id of the key it used."""

    tenant: str
    api_key_id: str


CONCURRENCY_LIMITED = "rate_limit_exceeded"  # the 429's code when a tenant is at its concurrency limit


@dataclass
class _Usage:
    in_flight: int = 0
    token_events: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens)
    admissions: deque[float] = field(default_factory=deque)  # times of the last minute's admissions


# How long refused requests are remembered for the operator's view (`TenantUsage.refusals`).
REFUSALS_WINDOW_S = 3600.0


class RefusalLog:
    """Requests refused (429) per tenant and error code, per minute, for the last
    `REFUSALS_WINDOW_S` (at most 61 minutes of counts per tenant, however fast a client retries)."""

    def __init__(self) -> None:
        self._minutes: dict[str, deque[tuple[int, dict[str, int]]]] = {}

    def add(self, tenant: str, code: str, count: int, now: float) -> None:
        minutes = self._minutes.setdefault(tenant, deque())
        minute = int(now // 60)
        if not minutes or minutes[-1][0] != minute:
            minutes.append((minute, {}))
        by_code = minutes[-1][1]
        by_code[code] = by_code.get(code, 0) + count
        self._forget(minutes, now)

    def totals(self, now: float) -> dict[str, dict[str, int]]:
        """The last hour's refusals (to the minute), per tenant and error code."""
        out: dict[str, dict[str, int]] = {}
        for tenant, minutes in list(self._minutes.items()):
            self._forget(minutes, now)
            if not minutes:
                del self._minutes[tenant]
            for _, by_code in minutes:
                totals = out.setdefault(tenant, {})
                for code, count in by_code.items():
                    totals[code] = totals.get(code, 0) + count
        return out

    @staticmethod
    def _forget(minutes: deque[tuple[int, dict[str, int]]], now: float) -> None:
        while minutes and (minutes[0][0] + 1) * 60 <= now - REFUSALS_WINDOW_S:
            minutes.popleft()


class TenantUsage:
    """Requests in flight and tokens used in the last minute, per tenant, against `TenantLimits`.

    Each admitted request is held by an `owner` (the API process that admitted it: "local" in one
    process; the control-plane benchmark's model of one shared counter names each replica). Not
    thread-safe: callers serialise (TenantRegistry under its lock). Several ingress replicas use
    budget leases instead (`tenant_budget.py`)."""

    def __init__(self) -> None:
        self._usage: dict[str, _Usage] = {}
        self._held: dict[str, dict[str, int]] = {}  # owner -> tenant -> requests in flight
        self._refusals = RefusalLog()

    def try_acquire(
        self, tenant: str, limits: TenantLimits, *, owner: str = "local", now: float | None = None
    ) -> RateLimitError | None:
        """Admit one request (None), or say why not (the 429 to raise; counted in `refusals`)."""
        now = time.monotonic() if now is None else now
        refusal = self._try_acquire(tenant, limits, owner, now)
        if refusal is not None:
            self._refusals.add(tenant, refusal.code or "rate_limited", 1, now)
        return refusal

    def refusals(self, *, now: float | None = None) -> dict[str, dict[str, int]]:
        """Requests refused (429) in the last `REFUSALS_WINDOW_S` (to the minute), per tenant and
        error code."""
        return self._refusals.totals(time.monotonic() if now is None else now)

    def _try_acquire(
        self, tenant: str, limits: TenantLimits, owner: str, now: float
    ) -> RateLimitError | None:
        usage = self._usage.setdefault(tenant, _Usage())
        if limits.max_concurrent_requests is not None and usage.in_flight >= limits.max_concurrent_requests:
            return RateLimitError(
                f"tenant {tenant!r} has {usage.in_flight} requests in flight "
                f"(limit {limits.max_concurrent_requests}); retry when one finishes",
                retry_after_s=1.0,
                code=CONCURRENCY_LIMITED,
            )
        if limits.tokens_per_minute is not None:
            while usage.token_events and usage.token_events[0][0] <= now - 60.0:
                usage.token_events.popleft()
            used = sum(tokens for _, tokens in usage.token_events)
            if used >= limits.tokens_per_minute:
                retry = 60.0 - (now - usage.token_events[0][0])
                return RateLimitError(
                    f"tenant {tenant!r} used {used} tokens in the last minute (limit {limits.tokens_per_minute})",
                    retry_after_s=max(1.0, math.ceil(retry)),
                    code="tokens_per_minute_exceeded",
                )
        if limits.requests_per_minute is not None:
            while usage.admissions and usage.admissions[0] <= now - 60.0:
                usage.admissions.popleft()
            if len(usage.admissions) >= limits.requests_per_minute:
                return RateLimitError(
                    f"tenant {tenant!r} sent {len(usage.admissions)} requests in the last minute "
                    f"(limit {limits.requests_per_minute})",
                    retry_after_s=max(1.0, math.ceil(60.0 - (now - usage.admissions[0]))),
                    code="requests_per_minute_exceeded",
                )
            usage.admissions.append(now)
        usage.in_flight += 1
        held = self._held.setdefault(owner, {})
        held[tenant] = held.get(tenant, 0) + 1
        return None

    def release(
        self, tenant: str, num_tokens: int, *, owner: str = "local", now: float | None = None
    ) -> None:
        """End one admitted request of `tenant` held by `owner`, which used `num_tokens` tokens."""
        now = time.monotonic() if now is None else now
        held = self._held.get(owner, {})
        if held.get(tenant, 0) > 0:
            held[tenant] -= 1
            usage = self._usage.setdefault(tenant, _Usage())
            usage.in_flight = max(0, usage.in_flight - 1)
        if num_tokens:
            self._usage.setdefault(tenant, _Usage()).token_events.append((now, num_tokens))

    def in_flight(self, tenant: str) -> int:
        usage = self._usage.get(tenant)
        return usage.in_flight if usage is not None else 0


class TenantRegistry:
    """Authenticates bearer keys and enforces per-tenant limits (thread-safe)."""

    def __init__(
        self,
        hashed_keys: dict[str, str],
        limits: TenantLimits | None = None,
        per_tenant_limits: dict[str, TenantLimits] | None = None,
        operator_keys: set[str] | frozenset[str] = frozenset(),
        directory: TenantDirectory | None = None,
    ) -> None:
        """`hashed_keys`: sha256(key) -> tenant (the bootstrap keys). `operator_keys`: sha256
        digests of the keys that may read operator routes (`/metrics`, `/v1/admin`); no tenant key
        can. `directory`: the live tenants and keys (its limits win over `limits` where set)."""
        self._keys = dict(hashed_keys)
        self._operator_keys = frozenset(operator_keys)
        self._default_limits = limits or TenantLimits()
        self._limits = per_tenant_limits or {}
        self._usage = TenantUsage()
        self._lock = threading.Lock()
        self.directory = directory
        self._refresher: threading.Thread | None = None
        self._stop_refresh = threading.Event()
        self._wake_refresh = threading.Event()
        self._seen_etag: tuple[float, str | None] | None = None  # (when, the directory etag the fleet saw)

    @classmethod
    def from_env(cls, keys_file: Path | None = None, limits: TenantLimits | None = None) -> TenantRegistry:
        spec = env_api_keys()
        if keys_file is not None:
            spec = keys_file.read_text() + "," + spec
        return cls(parse_keys(spec), limits)

    def authenticate(self, authorization: str | None) -> str:
        """'Bearer KEY' -> tenant id, or AuthenticationError (401)."""
        return self.identify(authorization).tenant

    def identify(self, authorization: str | None) -> Caller:
        """'Bearer KEY' -> its tenant and key id, or AuthenticationError (401)."""
        digest = bearer_digest(authorization, "API key")
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known, digest):
                return Caller(tenant, bootstrap_key_id(digest))
        if self.directory is not None:
            key = self.directory.snapshot.key_for_digest(digest)
            if key is not None:
                return Caller(key.tenant, key.id)
        raise AuthenticationError("invalid API key", code="invalid_api_key")

    def is_operator(self, authorization: str | None) -> bool:
        """Whether `authorization` carries an operator key (never raises)."""
        if not self._operator_keys or not authorization or not authorization.lower().startswith("bearer "):
            return False
        digest = hash_key(authorization[7:].strip())
        return any(hmac.compare_digest(known, digest) for known in self._operator_keys)

    def authenticate_operator(self, authorization: str | None) -> None:
        """Admit an operator key; 401 without a valid key, 403 for a tenant's key (or when no
        operator key is configured: operator routes are then closed)."""
        if not self._operator_keys:
            raise PermissionDeniedError(
                "this route needs an operator key, and none is configured: set TANDEM_OPERATOR_KEYS "
                "(or AppConfig.operator_keys)",
                code="operator_key_required",
            )
        digest = bearer_digest(authorization, "operator key")
        if any(hmac.compare_digest(known, digest) for known in self._operator_keys):
            return
        is_tenant_key = any(hmac.compare_digest(known, digest) for known in self._keys) or (
            self.directory is not None and self.directory.snapshot.tenant_for_digest(digest) is not None
        )
        if is_tenant_key:
            raise PermissionDeniedError("this route is for operators; tenant keys cannot read it")
        raise AuthenticationError("invalid operator key", code="invalid_api_key")

    def limits_for(self, tenant: str) -> TenantLimits:
        """The tenant's limits: the directory's where it sets one, else the configured defaults."""
        base = self._limits.get(tenant, self._default_limits)
        record = self._record(tenant)
        if record is None:
            return base
        spec = record.limits
        return TenantLimits(
            max_concurrent_requests=spec.max_concurrent_requests or base.max_concurrent_requests,
            tokens_per_minute=spec.tokens_per_minute or base.tokens_per_minute,
            requests_per_minute=spec.requests_per_minute or base.requests_per_minute,
        )

    def _record(self, tenant: str) -> Tenant | None:
        """The tenant in the directory as last read, if any."""
        return self.directory.snapshot.tenants.get(tenant) if self.directory is not None else None

    def adapter_limits_for(self, tenant: str) -> tuple[int | None, int | None]:
        """The tenant's own (max adapters, max adapter bytes) from the directory; None where unset."""
        record = self._record(tenant)
        return (
            (None, None) if record is None else (record.limits.max_adapters, record.limits.max_adapter_bytes)
        )

    def weight_for(self, tenant: str) -> float | None:
        """The tenant's fair-share weight from the directory (None: not set there)."""
        record = self._record(tenant)
        return None if record is None else record.weight

    def max_batch_tokens_queued_for(self, tenant: str) -> int | None:
        """The most output tokens the tenant's unfinished batches may ask for (None: no limit)."""
        record = self._record(tenant)
        return None if record is None else record.limits.max_batch_tokens_queued

    def max_tokens_for(self, tenant: str) -> int | None:
        """The most output tokens one of the tenant's requests may ask for (None: no limit)."""
        record = self._record(tenant)
        return None if record is None else record.limits.max_tokens

    def directory_seen(self, etag: str | None) -> None:
        """The directory's etag as the fleet state just read it (None: there is none). The
        refresh thread reads the directory only when it differs from the version held, and makes
        no store call of its own while these keep coming."""
        self._seen_etag = (time.monotonic(), etag)
        if self.directory is not None and etag != self.directory.snapshot.etag:
            self._wake_refresh.set()

    def start_refresh(self, interval_s: float) -> None:
        """Keep the directory current on a daemon thread: from the etags `directory_seen` gets
        (a read only on change), or, when none came in the last `5 x interval_s` (no fleet
        state), a HEAD of its own every `interval_s`. A store error is logged and retried at the
        next tick: the last version read stays in force meanwhile."""
        if self.directory is None or self._refresher is not None:
            return
        directory = self.directory

        def loop() -> None:
            while not self._stop_refresh.is_set():
                self._wake_refresh.wait(interval_s)
                self._wake_refresh.clear()
                if self._stop_refresh.is_set():
                    return
                seen = self._seen_etag
                try:
                    if seen is not None and time.monotonic() - seen[0] < 5 * interval_s:
                        directory.refresh_if_changed(seen[1])
                    else:
                        directory.refresh()
                except Exception as exc:  # noqa: BLE001 - keep serving the last version read
                    logger.warning(
                        "tenant directory refresh failed",
                        extra={"error": f"{type(exc).__name__}: {exc}"[:300]},
                    )

        self._refresher = threading.Thread(target=loop, name="tenant-directory-refresh", daemon=True)
        self._refresher.start()

    def stop_refresh(self) -> None:
        self._stop_refresh.set()
        self._wake_refresh.set()

    def acquire(self, tenant: str, *, now: float | None = None) -> None:
        """Admit one request or raise RateLimitError (429 with a retry-after hint)."""
        with self._lock:
            refusal = self._usage.try_acquire(tenant, self.limits_for(tenant), now=now)
        if refusal is not None:
            raise refusal

    def release(self, tenant: str, num_tokens: int, *, now: float | None = None) -> None:
        with self._lock:
            self._usage.release(tenant, num_tokens, now=now)

    def refusals(self) -> dict[str, dict[str, int]]:
        """This process's 429s of the last hour, per tenant and error code (`TenantUsage.refusals`)."""
        with self._lock:
            return self._usage.refusals()
