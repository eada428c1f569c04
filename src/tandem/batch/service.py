"""Files and batches on the object store: what the API routes and the workers share.

Every call takes the caller's tenant and only looks under that tenant's prefix, so another
tenant's file or batch id is simply not found (404). Batch records change only by
compare-and-swap (`update_batch`), so the API (cancel) and any number of workers (progress,
finalizing) never overwrite each other's changes.

Creating a batch writes its record (`validating`) and a queue pointer first, then validates the
input file and writes it as Parquet shards, then moves the record to `in_progress` (or `failed`
with every invalid line listed). If the process dies in between, a worker finds the pointer and
finishes the validation (`validate_batch` is idempotent).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection

from pydantic import BaseModel, Field

from tandem.batch.paging import check_limit, check_metadata, page, page_ids, record_ids
from tandem.batch.queue import BatchQueue
from tandem.batch.records import (
    BatchError,
    BatchRecord,
    FileRecord,
    batch_key,
    file_data_key,
    file_key,
    input_shard_key,
    new_object_id,
    queue_key,
    tenant_prefix,
)
from tandem.batch.shards import encode_inputs
from tandem.batch.validation import ValidatedFile, validate_batch_file
from tandem.platform.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
)
from tandem.platform.object_store import ObjectNotFound, ObjectStore, PreconditionFailed
from tandem.platform.tenancy import RateLimitError

logger = logging.getLogger("tandem.batch")

UPLOAD_PURPOSES = ("batch",)
COMPLETION_WINDOWS = ("24h",)


class BatchLimits(BaseModel):
    """Limits and timings of the batch API (also `AppConfig.batch`)."""

    max_file_bytes: int = Field(default=100 << 20, gt=0, description="Largest upload; more is 413.")
    max_file_lines: int = Field(
        default=50_000, gt=0, description="Most requests per input file; more is 413."
    )
    shard_size: int = Field(default=32, gt=0, description="Requests per Parquet shard (one lease each).")
    max_shards_in_flight: int = Field(
        default=2,
        gt=0,
        le=64,
        description="Shards one worker runs at once (each under its own lease): requests in flight "
        "are at most this times shard_size; the engines' batch admission decides what computes.",
    )
    lease_ttl_s: float = Field(
        default=12.0,
        gt=0,
        description="A shard's lease, renewed every third of it while its worker lives: a dead worker's "
        "shard runs again after this",
    )
    completion_window_s: float = Field(
        default=86400.0, gt=0, description="What '24h' means (tests shorten it)."
    )
    max_list_limit: int = 100


def _now() -> int:
    return int(time.time())


class BatchService:
    def __init__(
        self, store: ObjectStore, served_models: set[str], limits: BatchLimits | None = None,
        default_max_tokens: int = 256, *, endpoints: Collection[str],
    ) -> None:  # fmt: skip
        """`default_max_tokens`: what a line without `max_tokens` counts against a tenant's
        `max_queued_tokens` (the server's default for such requests). `endpoints`: the URLs a
        batch may name (the API's endpoint table: `deployments.openai.endpoints.ENDPOINTS`)."""
        self.store = store
        self.served_models = served_models
        self.endpoints = tuple(endpoints)
        self.limits = limits or BatchLimits()
        self.default_max_tokens = default_max_tokens
        self.queue = BatchQueue(store)

    # -- files -----------------------------------------------------------------------------
    def create_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> FileRecord:
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequestError(
                f"purpose {purpose!r} is not supported; use one of {list(UPLOAD_PURPOSES)}", param="purpose"
            )
        self.check_file_size(len(data))
        num_lines = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
        if num_lines > self.limits.max_file_lines:
            raise PayloadTooLargeError(
                f"the file has {num_lines} lines; a batch file may hold at most "
                f"{self.limits.max_file_lines} requests: split it into several batches",
                param="file",
                code="too_many_lines",
            )
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(
                f"a batch file must be UTF-8 JSONL text: {exc}", param="file", code="invalid_file_format"
            ) from exc
        record = FileRecord(
            id=new_object_id("file-"),
            tenant=tenant,
            bytes=len(data),
            created_at=_now(),
            filename=filename,
            purpose=purpose,
            num_lines=num_lines,
        )
        self.store.ensure_room(len(data) + 4096)  # a full disk is a 507 before anything is written
        self.write_file(record, data)
        return record

    def check_file_size(self, num_bytes: int) -> None:
        if num_bytes > self.limits.max_file_bytes:
            raise PayloadTooLargeError(
                f"the file is {num_bytes} bytes; the limit is {self.limits.max_file_bytes}",
                param="file",
                code="file_too_large",
            )

    def write_file(self, record: FileRecord, data: bytes) -> None:
        # Data first, record second: a listed file always has its content.
        self.store.put(file_data_key(record.tenant, record.id), data)
        self.store.put(file_key(record.tenant, record.id), record.model_dump_json().encode())

    def get_file(self, tenant: str, file_id: str) -> FileRecord:
        try:
            return FileRecord.model_validate_json(self.store.get(file_key(tenant, file_id)).data)
        except (ObjectNotFound, ValueError) as exc:
            raise NotFoundError(f"No such File object: {file_id}", param="file_id") from exc

    def file_content(self, tenant: str, file_id: str) -> bytes:
        self.get_file(tenant, file_id)
        return self.store.get(file_data_key(tenant, file_id)).data

    def delete_file(self, tenant: str, file_id: str) -> None:
        self.get_file(tenant, file_id)
        self.store.delete(file_key(tenant, file_id))
        self.store.delete(file_data_key(tenant, file_id))

    def list_files(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 100,
        order: str = "desc",
    ) -> tuple[list[FileRecord], bool]:
        limit = check_limit(limit, self.limits.max_list_limit)
        records: list[FileRecord] = []
        for file_id in page_ids(record_ids(self.store, f"{tenant_prefix(tenant)}files/"), after, order):
            record = self.get_file(tenant, file_id)  # read only as many records as the page needs
            if purpose is None or record.purpose == purpose:
                records.append(record)
                if len(records) > limit:
                    break
        return page(records, check_limit(limit, self.limits.max_list_limit))

    # -- batches: API side -------------------------------------------------------------------
    def create_batch(
        self,
        tenant: str,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None = None,
        max_queued_tokens: int | None = None,
        api_key_id: str | None = None,
    ) -> BatchRecord:
        """Create and validate a batch. With `max_queued_tokens` (the tenant's limit), a batch
        whose lines' output tokens (`ValidatedFile.num_output_tokens_requested`), with those the
        tenant's unfinished batches have yet to generate, would pass it is refused (429) before
        anything is written."""
        if endpoint not in self.endpoints:
            raise InvalidRequestError(
                f"endpoint {endpoint!r} is not supported; use one of {list(self.endpoints)}", param="endpoint"
            )
        if completion_window not in COMPLETION_WINDOWS:
            raise InvalidRequestError(
                f"completion_window must be one of {list(COMPLETION_WINDOWS)}", param="completion_window"
            )
        check_metadata(metadata)
        input_file = self.get_file(tenant, input_file_id)
        if input_file.purpose != "batch":
            raise InvalidRequestError(
                f"file {input_file_id} has purpose {input_file.purpose!r}; a batch needs purpose 'batch'",
                param="input_file_id",
            )
        # What the batch will write: its input shards, then each line's result and output line
        # (about 1 KiB plus 8 bytes a token each). A store that cannot hold it refuses now (507).
        self.store.ensure_room(
            input_file.bytes + 2 * input_file.num_lines * (1024 + 8 * self.default_max_tokens)
        )
        checked = None  # the input as validated for the limit, reused to start the batch
        if max_queued_tokens is not None:
            checked = self._check_queued_tokens(tenant, input_file_id, endpoint, max_queued_tokens)
        created = _now()
        record = BatchRecord(
            id=new_object_id("batch_"),
            tenant=tenant,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status="validating",
            created_at=created,
            expires_at=created + int(self.limits.completion_window_s),
            metadata=metadata,
            api_key_id=api_key_id,
        )
        self.store.put(batch_key(tenant, record.id), record.model_dump_json().encode(), if_none_match=True)
        self.store.put(queue_key(record.id), json.dumps({"tenant": tenant, "batch_id": record.id}).encode())
        return self.validate_batch(tenant, record.id, checked)

    def _check_queued_tokens(
        self, tenant: str, input_file_id: str, endpoint: str, limit: int
    ) -> ValidatedFile:
        """The input file validated; raises `RateLimitError` when it would pass `limit`."""
        checked = validate_batch_file(
            self.store.get(file_data_key(tenant, input_file_id)).data,
            endpoint,
            self.served_models,
            self.endpoints,
        )
        if checked.errors:
            return checked  # the batch fails validation and queues nothing
        new = checked.num_output_tokens_requested(self.default_max_tokens)
        queued = sum(record.num_output_tokens_queued for record in self._all_batches(tenant))
        if queued + new > limit:
            raise RateLimitError(
                f"this batch asks for up to {new} output tokens and tenant {tenant!r} has {queued} queued in "
                f"unfinished batches: together over its limit max_batch_tokens_queued = {limit}; wait for "
                "a batch to finish, send fewer lines or lower max_tokens",
                retry_after_s=60.0,
                code="batch_tokens_queued_exceeded",
            )
        return checked

    def _all_batches(self, tenant: str) -> list[BatchRecord]:
        return [self.get_batch(tenant, i) for i in record_ids(self.store, f"{tenant_prefix(tenant)}batches/")]

    def validate_batch(self, tenant: str, batch_id: str, checked: ValidatedFile | None = None) -> BatchRecord:
        """Validate the input (unless `checked` is its validation already) and write its shards;
        `validating` -> `in_progress` or `failed`. Idempotent: shards are a pure function of the
        input file, and the record moves on once."""
        record = self.get_batch(tenant, batch_id)
        if record.status != "validating":
            return record
        if checked is None:
            try:
                data = self.store.get(file_data_key(tenant, record.input_file_id)).data
            except ObjectNotFound:
                errors = [
                    BatchError(
                        code="file_not_found", message=f"input file {record.input_file_id} was deleted"
                    )
                ]
                return self._fail(tenant, batch_id, errors)
            checked = validate_batch_file(data, record.endpoint, self.served_models, self.endpoints)
        if checked.errors:
            return self._fail(tenant, batch_id, checked.errors)
        size = self.limits.shard_size
        shards = [checked.inputs[i : i + size] for i in range(0, len(checked.inputs), size)]
        for index, rows in enumerate(shards):
            self.store.put(input_shard_key(tenant, batch_id, index), encode_inputs(rows))

        def start(r: BatchRecord) -> bool:
            if r.status != "validating":
                return False
            r.status, r.in_progress_at = "in_progress", _now()
            r.model, r.num_requests, r.num_shards = checked.model, len(checked.inputs), len(shards)
            r.num_output_tokens_requested = checked.num_output_tokens_requested(self.default_max_tokens)
            return True

        record = self.update_batch(tenant, batch_id, start)
        logger.info(
            "batch validated",
            extra={
                "tenant": tenant,
                "batch_id": batch_id,
                "requests": record.num_requests,
                "shards": len(shards),
            },
        )
        return record

    def _fail(self, tenant: str, batch_id: str, errors: list[BatchError]) -> BatchRecord:
        def fail(r: BatchRecord) -> bool:
            if r.status != "validating":
                return False
            r.status, r.failed_at, r.errors = "failed", _now(), errors
            return True

        record = self.update_batch(tenant, batch_id, fail)
        self.store.delete(queue_key(batch_id))
        logger.info(
            "batch failed validation", extra={"tenant": tenant, "batch_id": batch_id, "errors": len(errors)}
        )
        return record

    def get_batch(self, tenant: str, batch_id: str) -> BatchRecord:
        return self.load_batch(tenant, batch_id)[0]

    def list_batches(
        self, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> tuple[list[BatchRecord], bool]:
        ids = record_ids(self.store, f"{tenant_prefix(tenant)}batches/")
        ids_of_page = page_ids(ids, after, "desc")[: check_limit(limit, self.limits.max_list_limit) + 1]
        return page(
            [self.get_batch(tenant, i) for i in ids_of_page], check_limit(limit, self.limits.max_list_limit)
        )

    def cancel_batch(self, tenant: str, batch_id: str) -> BatchRecord:
        def cancel(r: BatchRecord) -> bool:
            if r.status in ("cancelling", "cancelled"):
                return False
            if r.is_terminal or r.status == "finalizing":
                raise ConflictError(
                    f"Cannot cancel a batch with status {r.status!r}.",
                    param="batch_id",
                    code="batch_not_cancellable",
                )
            r.status, r.cancelling_at = "cancelling", _now()
            return True

        return self.update_batch(tenant, batch_id, cancel)

    # -- records ------------------------------------------------------------------------------
    def load_batch(self, tenant: str, batch_id: str) -> tuple[BatchRecord, str]:
        try:
            stored = self.store.get(batch_key(tenant, batch_id))
        except (ObjectNotFound, ValueError) as exc:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id") from exc
        return BatchRecord.model_validate_json(stored.data), stored.etag

    def update_batch(self, tenant: str, batch_id: str, mutate: Callable[[BatchRecord], bool]) -> BatchRecord:
        """Apply `mutate` by compare-and-swap, re-reading on conflict. `mutate` edits the record in
        place and returns False to leave it unchanged (it may raise to refuse)."""
        while True:
            record, etag = self.load_batch(tenant, batch_id)
            if not mutate(record):
                return record
            try:
                self.store.put(batch_key(tenant, batch_id), record.model_dump_json().encode(), if_match=etag)
                return record
            except PreconditionFailed:
                continue  # someone else changed it: re-read and re-apply

    def queued_batches(self) -> list[tuple[str, str]]:
        """(tenant, batch_id) of every batch not yet final, oldest first (`BatchQueue`)."""
        return self.queue.batches()
