"""Validation of a batch input file (JSONL, one request per line), as OpenAI does it.

Only problems with the file itself are checked here, as OpenAI does: not UTF-8, a line that is
not a JSON object, a missing or duplicate `custom_id`, a wrong `method` or `url`, a body that is not
an object or has no model, a model other than the batch's (its adapters, `base:adapter`, may
differ per line), a model not served. Each is collected with its 1-based line number, so a user can
fix the whole file at once, and a batch with any of them ends `failed` and runs nothing. A body the
endpoint would refuse (an invalid parameter, an unknown adapter) is the request's problem, not the
file's: the line runs like a real-time request and its 400 (or 404) response goes to the error
file while the rest of the batch runs.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field

from tandem.batch.records import BatchError
from tandem.batch.shards import BatchInput

MAX_REPORTED_ERRORS = 100


@dataclass
class ValidatedFile:
    inputs: list[BatchInput] = field(default_factory=list)
    errors: list[BatchError] = field(default_factory=list)
    model: str | None = None

    def num_output_tokens_requested(self, default_max_tokens: int) -> int:
        """The output tokens the lines may ask for: each line's `max_completion_tokens`,
        `max_tokens` or (Responses) `max_output_tokens` (an integer), else `default_max_tokens`."""
        total = 0
        for item in self.inputs:
            body = item.body
            asked = (
                body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
            )
            total += (
                asked
                if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0
                else default_max_tokens
            )
        return total

    def error(self, line: int, code: str, message: str, param: str | None = None) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(BatchError(code=code, message=message, param=param, line=line))


def validate_batch_file(
    data: bytes, endpoint: str, served_models: set[str], endpoints: Collection[str]
) -> ValidatedFile:
    """Parse and check every line against `endpoint` (one of the served `endpoints`) and the
    models this deployment serves."""
    result = ValidatedFile()
    if endpoint not in endpoints:
        result.error(0, "invalid_endpoint", f"endpoint must be one of {list(endpoints)}")
        return result
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        result.error(0, "invalid_file_format", f"the file is not UTF-8 text: {exc}")
        return result
    seen_ids: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            _check_line(result, number, raw, endpoint, seen_ids, served_models)
    if not result.inputs and not result.errors:
        result.error(0, "empty_file", "The input file holds no requests.")
    return result


def _envelope(
    result: ValidatedFile, number: int, raw: str, endpoint: str, seen_ids: dict[str, int]
) -> tuple[str, dict[str, object]] | None:
    """Line `number`'s custom id and parsed JSON object, its method and URL checked; None when
    it has a problem (in `result.errors`)."""
    try:
        line = json.loads(raw)
    except json.JSONDecodeError:
        result.error(number, "invalid_json_line", "This line is not parseable as valid JSON.")
        return None
    if not isinstance(line, dict):
        result.error(number, "invalid_request", "Each line must be a JSON object.")
        return None
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        result.error(
            number,
            "missing_required_parameter",
            "custom_id is required (a non-empty string).",
            "custom_id",
        )
        return None
    if custom_id in seen_ids:
        result.error(
            number,
            "duplicate_custom_id",
            "The custom_id for this request is a duplicate of another request (line "
            f"{seen_ids[custom_id]}). The custom_id parameter must be unique for each request in a batch.",
            "custom_id",
        )
        return None
    seen_ids[custom_id] = number
    if line.get("method", "POST") != "POST":
        result.error(number, "invalid_method", "method must be POST.", "method")
        return None
    if line.get("url") != endpoint:
        result.error(
            number,
            "invalid_url",
            f"The URL provided for this request ({line.get('url')!r}) does not match the batch "
            f"endpoint ({endpoint!r}).",
            "url",
        )
        return None
    return custom_id, line


def _check_line(
    result: ValidatedFile,
    number: int,
    raw: str,
    endpoint: str,
    seen_ids: dict[str, int],
    served_models: set[str],
) -> None:
    """Check line `number`: its problems go to `result.errors`, a good line to `result.inputs`."""
    envelope = _envelope(result, number, raw, endpoint, seen_ids)
    if envelope is None:
        return
    custom_id, line = envelope
    body = line.get("body")
    if not isinstance(body, dict):
        result.error(number, "invalid_request", "body must be a JSON object.", "body")
        return
    model = body.get("model")
    if not isinstance(model, str) or not model:
        result.error(number, "missing_required_parameter", "body.model is required (a string).", "body.model")
        return
    base = model.partition(":")[0]  # `base:adapter` names one of the tenant's LoRA adapters
    if result.model is None:
        result.model = base
    elif base != result.model:
        result.error(
            number,
            "mismatched_model",
            f"The model must be the same for every request in a batch (adapters of it may differ): "
            f"this line uses {base!r}, earlier lines {result.model!r}.",
            "body.model",
        )
        return
    if base not in served_models:
        result.error(
            number,
            "model_not_found",
            f"model {base!r} is not served here; available: {sorted(served_models)}",
            "body.model",
        )
        return
    result.inputs.append(BatchInput(line=number, custom_id=custom_id, body=body))
