"""Errors the engine's frontends raise for one request: refused at the door, or failed while it ran."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that can never run as given: a value out of range, a prompt too long, ...

    A ``ValueError``, so that callers of the offline API catch it as before.

    Args:
        message: what is wrong, for the user.
        param: the field at fault, by its engine-side name (a ``SamplingParams`` field, ``prompt`` or
            ``messages``); None when no single field is (the request as a whole does not fit).
    """

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple:  # pickled whole, as it crosses from the engine process
        return type(self), (self.message, self.param)

    def message_naming(self, name: str) -> str:
        """The message with its leading ``param`` (``"top_k must be >= 0"``) spelled ``name`` instead,
        for a client that set the field under another name; other messages are returned as they are."""
        if self.param is not None and self.message.startswith(f"{self.param} "):
            return name + self.message[len(self.param):]
        return self.message


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (a fault in its own state, inputs or sampling); it goes on
    serving the others.

    Args:
        request_id: the request, as its caller named it.
        reason: what failed, as the engine reported it.
    """

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id = request_id
        self.reason = reason

    def __reduce__(self) -> tuple:  # pickled whole, as it crosses from the engine process
        return type(self), (self.request_id, self.reason)


class EngineDeadError(RuntimeError):
    """The engine has stopped (crashed, its process died, or shut down); no request can run."""
