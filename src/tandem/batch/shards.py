"""Parquet encoding of input shards (requests) and result shards (answers).

An input shard holds up to `shard_size` requests of one batch, in file order. A result shard holds
one row per request of the input shard that ran (a cancelled shard may hold fewer): the request's
HTTP-like status code and either the response body or an error, both as JSON text.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

INPUT_SCHEMA = pa.schema([("line", pa.int64()), ("custom_id", pa.string()), ("body", pa.string())])
RESULT_SCHEMA = pa.schema(
    [
        ("line", pa.int64()),
        ("custom_id", pa.string()),
        ("request_id", pa.string()),
        ("status_code", pa.int32()),
        ("body", pa.string()),  # JSON; null when the request failed before producing a body
        ("error", pa.string()),  # JSON {"code", "message"}; null on success
        ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        # Metering (absent in shards written before it: read as null/0, and such lines are not metered).
        ("model", pa.string()),
        ("cached_tokens", pa.int64()),
        ("started_at", pa.float64()),  # epoch seconds
        ("finished_at", pa.float64()),
    ]
)


@dataclass
class BatchInput:
    line: int  # 1-based line number in the input file
    custom_id: str
    body: dict[str, Any]


@dataclass
class BatchResult:
    line: int
    custom_id: str
    request_id: str
    status_code: int
    body: dict[str, Any] | None
    error: dict[str, Any] | None
    input_tokens: int = 0
    output_tokens: int = 0
    model: str | None = None  # as the line's response named it
    cached_tokens: int = 0
    started_at: float = 0.0  # epoch seconds; 0 in shards written before metering
    finished_at: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status_code < 300

    def output_line(self, batch_request_id: str) -> dict[str, object]:
        """OpenAI's output/error file line."""
        return {
            "id": batch_request_id,
            "custom_id": self.custom_id,
            "response": (
                None
                if self.body is None
                else {"status_code": self.status_code, "request_id": self.request_id, "body": self.body}
            ),
            "error": self.error,
        }


def _to_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def encode_inputs(rows: list[BatchInput]) -> bytes:
    table = pa.Table.from_pydict(
        {
            "line": [r.line for r in rows],
            "custom_id": [r.custom_id for r in rows],
            "body": [json.dumps(r.body, separators=(",", ":")) for r in rows],
        },
        schema=INPUT_SCHEMA,
    )
    return _to_bytes(table)


def decode_inputs(data: bytes) -> list[BatchInput]:
    table = pq.read_table(io.BytesIO(data), schema=INPUT_SCHEMA)
    return [
        BatchInput(line=row["line"], custom_id=row["custom_id"], body=json.loads(row["body"]))
        for row in table.to_pylist()
    ]


def encode_results(rows: list[BatchResult]) -> bytes:
    def dumps(value: dict[str, object] | None) -> str | None:
        return None if value is None else json.dumps(value, separators=(",", ":"))

    table = pa.Table.from_pydict(
        {
            "line": [r.line for r in rows],
            "custom_id": [r.custom_id for r in rows],
            "request_id": [r.request_id for r in rows],
            "status_code": [r.status_code for r in rows],
            "body": [dumps(r.body) for r in rows],
            "error": [dumps(r.error) for r in rows],
            "input_tokens": [r.input_tokens for r in rows],
            "output_tokens": [r.output_tokens for r in rows],
            "model": [r.model for r in rows],
            "cached_tokens": [r.cached_tokens for r in rows],
            "started_at": [r.started_at for r in rows],
            "finished_at": [r.finished_at for r in rows],
        },
        schema=RESULT_SCHEMA,
    )
    return _to_bytes(table)


def decode_results(data: bytes) -> list[BatchResult]:
    """Result rows; a shard written before a column existed reads it as its default."""
    table = pq.read_table(io.BytesIO(data))
    for name in RESULT_SCHEMA.names:
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(table.num_rows, RESULT_SCHEMA.field(name).type))
    return [
        BatchResult(
            line=row["line"],
            custom_id=row["custom_id"],
            request_id=row["request_id"],
            status_code=row["status_code"],
            body=None if row["body"] is None else json.loads(row["body"]),
            error=None if row["error"] is None else json.loads(row["error"]),
            input_tokens=row["input_tokens"],
            output_tokens=row["output_tokens"],
            model=row["model"],
            cached_tokens=row["cached_tokens"] or 0,
            started_at=row["started_at"] or 0.0,
            finished_at=row["finished_at"] or 0.0,
        )
        for row in table.select(RESULT_SCHEMA.names).to_pylist()
    ]
