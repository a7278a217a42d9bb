"""The errors a user sees, each a SpecDecodeError. Each class declares how the server answers it: its HTTP
`status`, and OpenAI's error `type` and `code`; `param` names the request field it is about, where there is one.
The server maps an error by its class, never by its message (server/protocol.py: error_body)."""

from __future__ import annotations

import copy


class SpecDecodeError(ValueError):
    """A user-facing error: bad input, missing or corrupt model files, incompatible models.

    The CLI prints its message on one line and exits with status 2. Over HTTP this class itself is an invalid
    request (400) while a request is checked; once its generation runs, the scheduler answers a 500
    (EngineFailed) for any error not declared the client's or a passing one."""

    status = 400
    type = "invalid_request_error"
    code: str | None = "invalid_value"

    def __init__(self, message: str = "", *, param: str | None = None):
        super().__init__(message)
        self.param = param

    @property
    def message(self) -> str:
        return " ".join(str(self).split())  # on one line

    def headers(self) -> dict[str, str] | None:
        """HTTP headers its response carries (None: none)."""
        return None

    def about(self, param: str | None):
        """The same error about the request field `param` (the server names its fields as the wire does)."""
        other = copy.copy(self)
        other.param = param
        return other


class InvalidField(SpecDecodeError):
    """A named argument of a request has a bad value. `param` is the Engine's name for it (gamma,
    max_new_tokens, prompt, ...) until the server renames it for the wire."""


class MissingField(InvalidField):
    code = "missing_field"


class UnsupportedParameter(InvalidField):
    """An OpenAI field this server does not implement, asking for something."""

    code = "unsupported_parameter"


class InvalidJSON(SpecDecodeError):
    code = "invalid_json"


class ContextExceeded(InvalidField):
    """The prompt (or the prediction, or prompt + max_tokens) does not fit in the model's context."""

    code = "context_length_exceeded"


class ModelNotFound(InvalidField):
    status, code = 404, "model_not_found"

    def __init__(self, message: str = "", *, param: str | None = "model"):
        super().__init__(message, param=param)


class Unauthorized(SpecDecodeError):
    status, code = 401, "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFound(SpecDecodeError):
    status, code = 404, "not_found"


class MethodNotAllowed(SpecDecodeError):
    status, code = 405, "method_not_allowed"


class RequestTooLarge(SpecDecodeError):
    """A request body over the server's limit, refused before it is read."""

    status, code = 413, "request_too_large"


class UnsupportedMediaType(SpecDecodeError):
    """A body that is not declared JSON (Content-Type): a browser's cross-site form post must not reach a route."""

    status, code = 415, "unsupported_media_type"


class ServerFault(SpecDecodeError):
    """The server's own failure, not the request's."""

    status, type, code = 500, "server_error", "internal_error"


class EngineFailed(ServerFault):
    """A generation failed once it ran, for a reason retrying does not cure."""

    code = "engine_error"


class Unavailable(ServerFault):
    """The server cannot take or finish the request now; retrying later may work (Retry-After, where known)."""

    status, code = 503, "unavailable"

    def __init__(self, message: str = "", *, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}


class EngineUnavailable(Unavailable):
    """The backend could not run a pass now (its cache full, short of memory): a passing fault."""

    code = "engine_unavailable"


class Overloaded(Unavailable):
    """The queue is full."""

    code = "queue_full"


class QueueTimeout(Unavailable):
    """The request waited in the queue past its deadline."""

    code = "timeout"


class ShuttingDown(Unavailable):
    """The server began shutting down: no new job is taken."""

    code = "shutting_down"


class ReplicaLost(Unavailable):
    """The Ray replica serving a request stopped before it finished."""

    code = "replica_unavailable"


def positive_int(name: str, value):
    """`value` where it is an integer of at least 1 (a bool is not one); InvalidField naming `name` otherwise.
    Here, beside the error it raises, so that any module (the datastore, the load test) can use it without a cycle;
    checks.py hands it on."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidField(f"{name} must be a positive integer, got {value!r}", param=name)
    return value


class Interrupted(Exception):
    """A generation was asked to end while it read its prompt (its client is gone, or its deadline passed)."""
