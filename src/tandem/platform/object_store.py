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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse


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

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.url = "file://" + self.root
        self._lock_path = os.path.join(self.root, ".lock")
        self._thread_lock = threading.Lock()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *_check_key(key).split("/"))

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
            with open(self._path(key), "rb") as f:
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
        with contextlib.suppress(FileNotFoundError):
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
    endpoint which also reads `TANDEM_S3_ENDPOINT_URL` (for S3-compatible servers)."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None

    @classmethod
    def from_env(cls) -> S3Settings:
        return cls(
            endpoint_url=os.environ.get("TANDEM_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"),
            region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
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
                retries={"max_attempts": 5, "mode": "standard"},
            ),
        )

    def _key(self, key: str) -> str:
        return self.prefix + _check_key(key)

    @staticmethod
    def _code(exc: Exception) -> str:
        response = getattr(exc, "response", {}) or {}
        return str(response.get("Error", {}).get("Code", ""))

    def get(self, key: str) -> StoredObject:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except self.client.exceptions.NoSuchKey as exc:
            raise ObjectNotFound(key) from exc
        return StoredObject(response["Body"].read(), response["ETag"].strip('"'))

    def head(self, key: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            response = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if self._code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return str(response["ETag"]).strip('"')

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        from botocore.exceptions import ClientError

        conditions: dict[str, str] = {}
        if if_none_match:
            conditions["IfNoneMatch"] = "*"
        if if_match is not None:
            conditions["IfMatch"] = f'"{if_match}"'
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **conditions)
        except ClientError as exc:
            if self._code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise PreconditionFailed(f"{key}: {self._code(exc)}") from exc
            raise
        return str(response["ETag"]).strip('"')

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
            keys.extend(obj["Key"][len(self.prefix) :] for obj in page.get("Contents", []))
        return sorted(keys)


def open_object_store(url: str, settings: S3Settings | None = None) -> ObjectStore:
    """`file:///abs/path`, a plain path, or `s3://bucket[/prefix]`."""
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
