"""Validation of a batch input file (JSONL, one request per line), as OpenAI does it.

Every problem is collected with its 1-based line number, so a user can fix the whole file at once;
a batch with any invalid line ends `failed` with these errors and runs nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pydantic import ValidationError

from tandem.batch.records import BatchError
from tandem.batch.shards import BatchInput
from tandem.platform.errors import TandemError
from tandem.platform.openai_schemas import ChatCompletionRequest, CompletionRequest, reject_unsupported

MAX_REPORTED_ERRORS = 100

_REQUEST_MODELS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


@dataclass
class ValidatedFile:
    inputs: list[BatchInput] = field(default_factory=list)
    errors: list[BatchError] = field(default_factory=list)
    model: str | None = None

    def error(self, line: int, code: str, message: str, param: str | None = None) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(BatchError(code=code, message=message, param=param, line=line))


def validate_batch_file(data: bytes, endpoint: str, served_models: set[str]) -> ValidatedFile:
    """Parse and check every line against `endpoint` and the models this deployment serves."""
    result = ValidatedFile()
    request_model = _REQUEST_MODELS[endpoint]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        result.error(0, "invalid_file_format", f"the file is not UTF-8 text: {exc}")
        return result
    seen_ids: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            result.error(number, "invalid_json_line", "This line is not parseable as valid JSON.")
            continue
        if not isinstance(line, dict):
            result.error(number, "invalid_request", "Each line must be a JSON object.")
            continue
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            result.error(
                number,
                "missing_required_parameter",
                "custom_id is required (a non-empty string).",
                "custom_id",
            )
            continue
        if custom_id in seen_ids:
            result.error(
                number,
                "duplicate_custom_id",
                "The custom_id for this request is a duplicate of another request (line "
                f"{seen_ids[custom_id]}). The custom_id parameter must be unique for each request in a batch.",
                "custom_id",
            )
            continue
        seen_ids[custom_id] = number
        if line.get("method", "POST") != "POST":
            result.error(number, "invalid_method", "method must be POST.", "method")
            continue
        if line.get("url") != endpoint:
            result.error(
                number,
                "invalid_url",
                f"The URL provided for this request ({line.get('url')!r}) does not match the batch "
                f"endpoint ({endpoint!r}).",
                "url",
            )
            continue
        body = line.get("body")
        if not isinstance(body, dict):
            result.error(number, "invalid_request", "body must be a JSON object.", "body")
            continue
        if body.get("stream"):
            result.error(number, "invalid_request", "stream is not supported in a batch.", "body.stream")
            continue
        try:
            reject_unsupported(body)
            request = request_model.model_validate(body)
        except TandemError as exc:
            result.error(number, exc.code or "invalid_request", exc.message, f"body.{exc.param}")
            continue
        except ValidationError as exc:
            first = exc.errors()[0]
            param = "body." + ".".join(str(p) for p in first["loc"])
            result.error(number, "invalid_request", f"{param}: {first['msg']}", param)
            continue
        if result.model is None:
            result.model = request.model
        elif request.model != result.model:
            result.error(
                number,
                "mismatched_model",
                f"The model must be the same for every request in a batch: this line uses "
                f"{request.model!r}, earlier lines {result.model!r}.",
                "body.model",
            )
            continue
        if request.model not in served_models:
            result.error(
                number,
                "model_not_found",
                f"model {request.model!r} is not served here; available: {sorted(served_models)}",
                "body.model",
            )
            continue
        result.inputs.append(BatchInput(line=number, custom_id=custom_id, body=body))
    if not result.inputs and not result.errors:
        result.error(0, "empty_file", "The input file holds no requests.")
    return result
