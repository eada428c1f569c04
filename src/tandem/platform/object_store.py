"""Object store with the two conditional writes the batch queue is built on.

`ObjectStore` is a flat key -> bytes map with etags:

- `put(key, data, if_none_match=True)`: create only if absent (put-if-absent). Used to commit a
  shard's results exactly once: the second writer gets `PreconditionFailed` and discards its copy.
- `put(key, data, if_match=etag)`: compare-and-swap. Used for leases and batch records: a
  writer that read a stale version gets `PreconditionFailed` and must re-read.

Two implementations: `FileObjectStore` (`file://` URLs, the embedded default; atomic renames plus
an inter-process lock make the conditions hold across processes on one host) and
`S3ObjectStore` (`s3://bucket/prefix`, boto3 with S3's `If-None-Match: *` / `If-Match`
conditional PUTs, path-style addressing, checksums only when required so that non-AWS servers
such as SeaweedFS and MinIO work). Etags are opaque strings; compare them, never parse them.

Failures: a store that is down, stalled or answers a server error raises `StoreUnavailableError`
(HTTP 503 with Retry-After at the API) within a bounded time (S3: `S3Settings`' connect and read
timeouts and retry budget, not boto3's minutes); a full disk raises `InsufficientStorageError`
(507). `store_guard.open_object_store` wraps either store in a `GuardedStore`, which fails
fast while the store is known to be down.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

from tandem.platform.errors import InsufficientStorageError, StoreUnavailableError


class ObjectNotFound(KeyError):
    """The key does not exist (or a conditional delete found nothing)."""


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (if_none_match) or changed (if_match)."""


@dataclass(frozen=True)
class StoredObject:
    data: bytes
    etag: str


class ObjectStore(ABC):
    """Keys are '/'-separated relative paths without '..'; listing is in key order."""

    url: str

    @abstractmethod
    def get(self, key: str) -> StoredObject: ...

    @abstractmethod
    def head(self, key: str) -> str | None:
        """The etag of `key`, or None when absent."""

    @abstractmethod
    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write `data`; returns the new etag. Raises `PreconditionFailed` when a condition fails."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key`; absent keys are not an error."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`, sorted."""

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def ensure_room(self, num_bytes: int) -> None:  # noqa: B027 - a no-op unless the store has a disk
        """Raise `InsufficientStorageError` when `num_bytes` more would not fit (a store with a
        disk of its own checks it; S3 has no such limit)."""

    def healthy_for_s(self) -> float:
        """Seconds since the store last failed (infinite when it never did, or cannot tell)."""
        return float("inf")


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid object key {key!r}")
    return key


def _etag(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


class FileObjectStore(ObjectStore):
    """Objects are files under `root`. Writes go to a temp file and are renamed into place, so a
    reader never sees half an object; conditional writes hold an exclusive `flock` on
    `root/.lock`, so they are atomic across threads and processes sharing the directory."""

    def __init__(self, root: str, *, min_free_bytes: int | None = None) -> None:
        """`min_free_bytes`: what an upload or batch must leave free on the disk (`ensure_room`;
        default `TANDEM_STORE_MIN_FREE_MB`, else 64 MiB)."""
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.url = "file://" + self.root
        if min_free_bytes is None:
            min_free_bytes = int(float(os.environ.get("TANDEM_STORE_MIN_FREE_MB", "64")) * 2**20)
        self.min_free_bytes = min_free_bytes
        self._lock_path = os.path.join(self.root, ".lock")
        self._thread_lock = threading.Lock()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *_check_key(key).split("/"))

    def ensure_room(self, num_bytes: int) -> None:
        free = shutil.disk_usage(self.root).free
        if free - num_bytes < self.min_free_bytes:
            raise InsufficientStorageError(
                f"the object store's disk has {free // 2**20} MiB free; this needs {num_bytes // 2**20 + 1} MiB "
                f"and {self.min_free_bytes // 2**20} MiB must stay free: delete files or batches, or retry later"
            )

    @staticmethod
    @contextlib.contextmanager
    def _disk_errors(key: str) -> Iterator[None]:
        """A full disk -> `InsufficientStorageError`; another I/O failure -> `StoreUnavailableError`."""
        try:
            yield
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise InsufficientStorageError(f"the object store's disk is full (writing {key})") from exc
            raise StoreUnavailableError(
                f"the object store failed ({errno.errorcode.get(exc.errno or 0, exc)})"
            ) from exc

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock, open(self._lock_path, "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def get(self, key: str) -> StoredObject:
        try:
            with self._disk_errors(key), open(self._path(key), "rb") as f:
                data = f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ObjectNotFound(key) from exc
        return StoredObject(data, _etag(data))

    def head(self, key: str) -> str | None:
        try:
            return self.get(key).etag
        except ObjectNotFound:
            return None

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        with self._disk_errors(key):
            return self._put(key, data, if_none_match=if_none_match, if_match=if_match)

    def _put(self, key: str, data: bytes, *, if_none_match: bool, if_match: str | None) -> str:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            if not if_none_match and if_match is None:
                os.replace(tmp, path)
                return _etag(data)
            with self._locked():
                current = self.head(key)
                if if_none_match and current is not None:
                    raise PreconditionFailed(f"{key} already exists")
                if if_match is not None and current != if_match:
                    raise PreconditionFailed(f"{key} changed (expected etag {if_match}, found {current})")
                os.replace(tmp, path)
            return _etag(data)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def delete(self, key: str) -> None:
        with self._disk_errors(key), contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))

    def list(self, prefix: str) -> list[str]:
        keys = []
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = os.path.join(self.root, *base.split("/")) if base else self.root
        for directory, _, files in os.walk(start):
            rel_dir = os.path.relpath(directory, self.root)
            for name in files:
                if name.startswith("."):
                    continue
                key = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)


@dataclass(frozen=True)
class S3Settings:
    """Connection settings; unset fields fall back to boto3's environment lookup, except the
    endpoint which also reads `TANDEM_S3_ENDPOINT_URL` (for S3-compatible servers).

    The time budget of one call: `connect_timeout_s` to connect, `read_timeout_s` for each wait
    on the server, `max_attempts` tries in all (boto3's standard retry mode: throttling, 5xx,
    connection errors). A call that a stopped or frozen store cannot answer fails with
    `StoreUnavailableError` after at most about max_attempts x (connect + read) timeouts
    (`TANDEM_S3_CONNECT_TIMEOUT_S`, `TANDEM_S3_READ_TIMEOUT_S`, `TANDEM_S3_MAX_ATTEMPTS`)."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 3.0
    max_attempts: int = 1

    @classmethod
    def from_env(cls) -> S3Settings:
        env = os.environ
        return cls(
            endpoint_url=env.get("TANDEM_S3_ENDPOINT_URL") or env.get("AWS_ENDPOINT_URL_S3"),
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            connect_timeout_s=float(env.get("TANDEM_S3_CONNECT_TIMEOUT_S", cls.connect_timeout_s)),
            read_timeout_s=float(env.get("TANDEM_S3_READ_TIMEOUT_S", cls.read_timeout_s)),
            max_attempts=int(env.get("TANDEM_S3_MAX_ATTEMPTS", cls.max_attempts)),
        )


class S3ObjectStore(ObjectStore):
    """Objects under `s3://bucket/prefix/`. Conditional PUTs need an S3 server that implements
    them (AWS S3 since 2024, SeaweedFS, MinIO); 412 responses become `PreconditionFailed`."""

    def __init__(self, bucket: str, prefix: str = "", settings: S3Settings | None = None) -> None:
        import boto3
        from botocore.config import Config

        settings = settings or S3Settings.from_env()
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self.client = boto3.client(
            "s3",
            endpoint_url=settings.endpoint_url,
            region_name=settings.region,
            aws_access_key_id=settings.access_key_id,
            aws_secret_access_key=settings.secret_access_key,
            config=Config(
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                retries={"total_max_attempts": settings.max_attempts, "mode": "standard"},
                connect_timeout=settings.connect_timeout_s,
                read_timeout=settings.read_timeout_s,
            ),
        )

    def _key(self, key: str) -> str:
        return self.prefix + _check_key(key)

    @staticmethod
    def _code(exc: Exception) -> str:
        response = getattr(exc, "response", {}) or {}
        return str(response.get("Error", {}).get("Code", ""))

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """botocore's failures in the platform's terms: a missing key and a lost condition pass
        through as `ObjectNotFound` / `PreconditionFailed`; no answer in time, a connection error
        or a 5xx is `StoreUnavailableError`; a full server `InsufficientStorageError`; any other
        refusal (credentials, bucket) `StoreUnavailableError` naming its code."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            code = self._code(exc)
            if code in ("404", "NoSuchKey", "NotFound"):
                raise ObjectNotFound(key) from exc
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise PreconditionFailed(f"{key}: {code}") from exc
            if code in ("507", "XMinioStorageFull", "InsufficientStorage", "EntityTooLarge"):
                raise InsufficientStorageError(f"the object store is full ({code})") from exc
            raise StoreUnavailableError(
                f"the object store refused the call ({code or 'unknown error'})"
            ) from exc
        except BotoCoreError as exc:
            raise StoreUnavailableError(f"the object store did not answer ({type(exc).__name__})") from exc

    def get(self, key: str) -> StoredObject:
        with self._errors(key):
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return StoredObject(response["Body"].read(), response["ETag"].strip('"'))

    def head(self, key: str) -> str | None:
        try:
            with self._errors(key):
                response = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ObjectNotFound:
            return None
        return str(response["ETag"]).strip('"')

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        conditions: dict[str, str] = {}
        if if_none_match:
            conditions["IfNoneMatch"] = "*"
        if if_match is not None:
            conditions["IfMatch"] = f'"{if_match}"'
        with self._errors(key):
            response = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **conditions)
        return str(response["ETag"]).strip('"')

    def delete(self, key: str) -> None:
        with contextlib.suppress(ObjectNotFound), self._errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        with self._errors(prefix):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                keys.extend(obj["Key"][len(self.prefix) :] for obj in page.get("Contents", []))
        return sorted(keys)


def open_raw_object_store(url: str, settings: S3Settings | None = None) -> ObjectStore:
    """The store at `url` without the guard (tests of the stores themselves)."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"object store URL {url!r} names no bucket (s3://bucket/prefix)")
        return S3ObjectStore(parsed.netloc, parsed.path, settings)
    if parsed.scheme == "file":
        return FileObjectStore(parsed.path)
    if parsed.scheme == "":
        return FileObjectStore(url)
    raise ValueError(f"unsupported object store URL {url!r}: use file:// or s3://")
