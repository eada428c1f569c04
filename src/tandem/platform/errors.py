"""Errors shared by every layer, each mapping to one HTTP status at the API edge."""

from __future__ import annotations


class TandemError(Exception):
    """Base class. `status_code` and `code` follow OpenAI's error body at the HTTP edge."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(TandemError, ValueError):
    """The request is malformed or a field is out of range (HTTP 400). `param` names the field."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """The prompt does not fit the model's context window."""

    def __init__(self, message: str, *, param: str | None = "prompt") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class OverloadedError(TandemError):
    """Every replica's queue is full (HTTP 429 with Retry-After): back off and retry."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, code="server_overloaded")
        self.retry_after_s = retry_after_s


class BatchCapacityError(OverloadedError):
    """A replica already runs as many batch requests as it takes (`max_batch_requests`); batch
    workers wait and send the line again. Never shown to a client: batch lines are retried."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = "batch_capacity"


class ModelLoadError(TandemError):
    """A model path is missing, or a weight or tokenizer file is corrupt or unsupported."""

    status_code = 404
    error_type = "model_load_error"


class NotFoundError(TandemError):
    """The object does not exist, or belongs to another tenant (HTTP 404; the two look the same)."""

    status_code = 404
    error_type = "invalid_request_error"


class ConflictError(TandemError):
    """The object's state does not allow the operation (HTTP 409), e.g. cancelling a finished batch."""

    status_code = 409
    error_type = "invalid_request_error"


class PayloadTooLargeError(TandemError):
    """A body or file is over a size or line limit (HTTP 413)."""

    status_code = 413
    error_type = "invalid_request_error"


class RequestFailedError(TandemError):
    """The request was valid but could not be computed (HTTP 500, `server_error`): the engine
    ended it alone (`request_failed`, `kv_integrity`) or its engine failed (`engine_failed`).
    The message is safe to show the client; the details are in the server log."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, code: str = "request_failed") -> None:
        super().__init__(message, code=code)


class ServiceUnavailableError(TandemError):
    """No engine can take the request now (HTTP 503): it is starting or being replaced."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, *, code: str = "engine_unavailable") -> None:
        super().__init__(message, code=code)


class ShuttingDownError(ServiceUnavailableError):
    """The server is draining before it stops (HTTP 503 with `Retry-After`): it takes no new
    request, and a request still running at the end of the drain ends with this error."""

    def __init__(self, message: str, *, retry_after_s: float = 5.0) -> None:
        super().__init__(message, code="shutting_down")
        self.retry_after_s = retry_after_s


class ReplicaLostError(ServiceUnavailableError):
    """The model replica serving the request died under it (HTTP 503): not the request's fault,
    and safe to retry from the start (Serve is replacing the replica; others may serve it now)."""

    def __init__(
        self, message: str = "the model replica serving this request stopped; retry the request"
    ) -> None:
        super().__init__(message, code="replica_lost")


class StoreUnavailableError(ServiceUnavailableError):
    """The object store did not answer in time or answered with a server error (HTTP 503 with
    `Retry-After`, code `store_unavailable`): files, batches, usage queries and the operator's
    tenant changes wait for it; chat and completions never do."""

    def __init__(self, message: str, *, retry_after_s: float = 5.0) -> None:
        super().__init__(message, code="store_unavailable")
        self.retry_after_s = retry_after_s


class InsufficientStorageError(TandemError):
    """The object store's disk cannot take this write (HTTP 507, code `insufficient_storage`):
    checked before an upload or a batch is accepted, and raised when a write hits a full disk."""

    status_code = 507
    error_type = "server_error"

    def __init__(self, message: str, *, retry_after_s: float = 60.0) -> None:
        super().__init__(message, code="insufficient_storage")
        self.retry_after_s = retry_after_s
