"""Stored records of files and batches, and where everything lives in the object store.

Records are pydantic models stored as JSON; `api()` gives OpenAI's object shape (internal fields
such as the tenant and per-shard counts are not shown). Layout, per tenant `t`:

    tenants/t/files/{file_id}.json         FileRecord
    tenants/t/file-data/{file_id}          the file's bytes
    tenants/t/batches/{batch_id}.json      BatchRecord (updated by compare-and-swap only)
    tenants/t/batch-data/{batch_id}/input/{shard:05d}.parquet     requests of one shard
    tenants/t/batch-data/{batch_id}/results/{shard:05d}.parquet   committed results (put-if-absent)
    tenants/t/batch-data/{batch_id}/leases/{name}.json            worker leases (compare-and-swap)
    queue/{batch_id}.json                  pointer {tenant, batch_id} while the batch is not final

Ids start with a millisecond timestamp, so key order is creation order.
"""

from __future__ import annotations

import secrets
import time
from typing import Literal
from urllib.parse import quote

from pydantic import BaseModel, Field

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
TERMINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})


def new_object_id(prefix: str) -> str:
    """`prefix` + 12 hex digits of milliseconds + 12 random hex digits: sortable by creation."""
    return f"{prefix}{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def tenant_prefix(tenant: str) -> str:
    return f"tenants/{quote(tenant, safe='')}/"


def file_key(tenant: str, file_id: str) -> str:
    return f"{tenant_prefix(tenant)}files/{file_id}.json"


def file_data_key(tenant: str, file_id: str) -> str:
    return f"{tenant_prefix(tenant)}file-data/{file_id}"


def batch_key(tenant: str, batch_id: str) -> str:
    return f"{tenant_prefix(tenant)}batches/{batch_id}.json"


def batch_data_prefix(tenant: str, batch_id: str) -> str:
    return f"{tenant_prefix(tenant)}batch-data/{batch_id}/"


def input_shard_key(tenant: str, batch_id: str, shard: int) -> str:
    return f"{batch_data_prefix(tenant, batch_id)}input/{shard:05d}.parquet"


def result_shard_key(tenant: str, batch_id: str, shard: int) -> str:
    return f"{batch_data_prefix(tenant, batch_id)}results/{shard:05d}.parquet"


def lease_key(tenant: str, batch_id: str, name: str) -> str:
    return f"{batch_data_prefix(tenant, batch_id)}leases/{name}.json"


def queue_key(batch_id: str) -> str:
    return f"queue/{batch_id}.json"


QUEUE_PREFIX = "queue/"


class FileRecord(BaseModel):
    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    num_lines: int = 0

    def api(self) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


class ShardCounts(BaseModel):
    """What one committed result shard holds."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchRecord(BaseModel):
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    model: str | None = None
    metadata: dict[str, str] | None = None
    errors: list[BatchError] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    num_requests: int = 0
    num_output_tokens_requested: int = 0  # what its lines may generate (max_tokens, or the default)
    api_key_id: str | None = None  # the key that created it (its lines' usage names it)
    num_shards: int = 0
    shard_counts: dict[int, ShardCounts] = Field(default_factory=dict)  # committed shards only

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def num_output_tokens_queued(self) -> int:
        """Of `num_output_tokens_requested`, the share of the lines not answered yet (0 once it ended)."""
        if self.is_terminal or not self.num_requests:
            return 0
        totals = self.totals()
        remaining = self.num_requests - totals.completed - totals.failed
        return self.num_output_tokens_requested * max(0, remaining) // self.num_requests

    def totals(self) -> ShardCounts:
        total = ShardCounts()
        for counts in self.shard_counts.values():
            total.completed += counts.completed
            total.failed += counts.failed
            total.input_tokens += counts.input_tokens
            total.output_tokens += counts.output_tokens
        return total

    def num_lines_left(self) -> int:
        """Lines neither completed nor failed (none once expired: those count as failed)."""
        totals = self.totals()
        failed = self.num_requests - totals.completed if self.status == "expired" else totals.failed
        return self.num_requests - totals.completed - failed

    def api(self) -> dict[str, object]:
        totals = self.totals()
        failed = totals.failed
        if self.status == "expired":  # requests that never ran are reported as failed
            failed = self.num_requests - totals.completed
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": (
                {"object": "list", "data": [e.model_dump() for e in self.errors]} if self.errors else None
            ),
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {
                "total": self.num_requests,
                "completed": totals.completed,
                "failed": failed,
            },
            "usage": {
                "input_tokens": totals.input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": totals.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": totals.input_tokens + totals.output_tokens,
            },
            "metadata": self.metadata,
        }
