"""`GuardedStore`: an `ObjectStore` that fails fast while its store is down (a circuit breaker).

A store that is stopped answers at once (connection refused), but one that is frozen or
overloaded makes every caller wait its full timeout. After a call fails with
`StoreUnavailableError`, the guard answers every call with `StoreUnavailableError` (Retry-After:
the time left) for `cooldown_s`, without touching the store; after that one call at a time is let
through as a probe: its success closes the circuit, its failure opens it for another cooldown. A
full disk (`InsufficientStorageError`), a missing key and a lost condition are answers, not
failures: they pass through and never open the circuit.

`healthy_for_s()` says how long the store has answered since it last failed: a lease holder
could not renew while the store was down, so claimants give it one renewal period after a
recovery before they take over its lease (`LeaseManager.try_claim`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from tandem.platform.errors import StoreUnavailableError
from tandem.platform.object_store import ObjectStore, S3Settings, StoredObject, open_raw_object_store

T = TypeVar("T")


class GuardedStore(ObjectStore):
    def __init__(self, inner: ObjectStore, *, cooldown_s: float = 2.0) -> None:
        self.inner = inner
        self.url = inner.url
        self.cooldown_s = cooldown_s
        self._lock = threading.Lock()
        self._open_until = -math.inf  # monotonic time the circuit stays open until
        self._probing = False  # a probe call is in flight (half-open)
        self._healthy_since = -math.inf  # monotonic time of the first success after the last failure
        self._last_error = ""
        self.num_failures = 0  # calls that failed with StoreUnavailableError (not the fast ones)
        self.num_fast_failures = 0  # calls answered by the open circuit

    @property
    def is_open(self) -> bool:
        """Whether calls are being refused without trying the store."""
        return time.monotonic() < self._open_until

    def healthy_for_s(self) -> float:
        with self._lock:
            if self._open_until == -math.inf and self._healthy_since == -math.inf:
                return math.inf  # it never failed
            if self._healthy_since == -math.inf:
                return 0.0
            return time.monotonic() - self._healthy_since

    def _call(self, fn: Callable[[], T]) -> T:
        probe = False
        with self._lock:
            now = time.monotonic()
            if now < self._open_until or (self._open_until != -math.inf and self._probing):
                self.num_fast_failures += 1
                remaining = max(1.0, math.ceil(self._open_until - now))
                raise StoreUnavailableError(
                    f"the object store is unavailable ({self._last_error}); retry in a few seconds",
                    retry_after_s=remaining,
                )
            if self._open_until != -math.inf:
                self._probing = probe = True
        try:
            result = fn()
        except StoreUnavailableError as exc:
            with self._lock:
                self.num_failures += 1
                self._last_error = exc.message
                self._open_until = time.monotonic() + self.cooldown_s
                self._healthy_since = -math.inf
                if probe:
                    self._probing = False
            exc.retry_after_s = max(exc.retry_after_s, self.cooldown_s)
            raise
        except BaseException:
            if probe:
                with self._lock:
                    self._probing = False
            raise
        with self._lock:
            if self._open_until != -math.inf:  # the first success since a failure: closed again
                self._open_until = -math.inf
                self._healthy_since = time.monotonic()
            self._probing = False
        return result

    # -- ObjectStore, through the guard -----------------------------------------------------------
    def get(self, key: str) -> StoredObject:
        return self._call(lambda: self.inner.get(key))

    def head(self, key: str) -> str | None:
        return self._call(lambda: self.inner.head(key))

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        return self._call(lambda: self.inner.put(key, data, if_none_match=if_none_match, if_match=if_match))

    def delete(self, key: str) -> None:
        self._call(lambda: self.inner.delete(key))

    def list(self, prefix: str) -> list[str]:
        return self._call(lambda: self.inner.list(prefix))

    def ensure_room(self, num_bytes: int) -> None:
        self.inner.ensure_room(num_bytes)


def open_object_store(url: str, settings: S3Settings | None = None) -> ObjectStore:
    """`file:///abs/path`, a plain path, or `s3://bucket[/prefix]`, behind a `GuardedStore`."""
    return GuardedStore(open_raw_object_store(url, settings))
