"""The ways a step ends in failure, as exceptions a handler raises (or lets through).

Each `StepError` subclass is one of the protocol's error classes: the worker retries a
`Temporary`, and stops the run for a person on the others. `AttemptRefused` is not a step error:
it says the worker no longer accepts this attempt (or cannot be asked again without paying twice),
so nothing the handler does matters any more.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar


class StepError(Exception):
    """A step failure the worker should know by class; raise a subclass, not this one."""

    #: The protocol's name for the class (`"error": {"class": ...}`).
    wire_class: ClassVar[str] = "unknown"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict[str, Any]:
        """The `{"class", "message"}` object the protocol carries for this error."""
        return {"class": self.wire_class, "message": self.message}


class Temporary(StepError):
    """Worth retrying: the worker runs the step again (same keys) after a backoff.

    `retry_after` (seconds) asks for at least that long before the retry, as a 429's
    `retry-after` would.
    """

    wire_class = "temporary"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        if retry_after is not None and not (
            isinstance(retry_after, (int, float))
            and not isinstance(retry_after, bool)
            and math.isfinite(retry_after)
            and retry_after >= 0
        ):
            raise ValueError(f"retry_after must be a number of seconds >= 0, got {retry_after!r}")
        super().__init__(message)
        self.retry_after = retry_after

    def to_wire(self) -> dict[str, Any]:
        wire = super().to_wire()
        if self.retry_after is not None:
            wire["retry_after_ms"] = round(self.retry_after * 1000)
        return wire


class Unknown(StepError):
    """Not safe to retry blindly: the run stops in `needs_review` with the message as its note."""

    wire_class = "unknown"


class Conflict(StepError):
    """An idempotency key was reused with another request: a person looks at it."""

    wire_class = "conflict"


class Auth(StepError):
    """Credentials or configuration are wrong: no retry helps, a person fixes the deploy."""

    wire_class = "auth"


#: The code of an `AttemptRefused` the SDK raises itself: a callback's answer was lost.
ANSWER_LOST = "answer_lost"


class AttemptRefused(BaseException):
    """This attempt is over: the worker refused a callback (401, 409, 400, 410), or a callback's
    answer was lost (code `answer_lost`).

    Its work is void (a newer attempt, or none, carries the run on). It derives from
    `BaseException`, as `asyncio.CancelledError` does, so that a handler's generic
    `except Exception:` cannot swallow it and go on as if the attempt were alive: every later
    callback of the attempt raises it again without sending, and the step's answer is this
    error whatever the handler returns. Handlers should let it through.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def to_wire(self) -> dict[str, Any]:
        """The step's answer for an attempt that ended so.

        A lost answer is `temporary`: the worker retries the step, and the retry's callbacks
        find what the lost one did (a model answer in the journal, an effect's record). A
        refusal is `unknown` (the worker discards the answer of an attempt it refused anyway;
        should one arrive, review is the safe reading).
        """
        if self.code == ANSWER_LOST:
            return {"class": "temporary", "message": self.message}
        return {"class": "unknown", "message": f"the attempt was refused by the worker: {self}"}


_CLASSES: dict[str, type[StepError]] = {
    cls.wire_class: cls for cls in (Temporary, Unknown, Conflict, Auth)
}


def from_wire(error: dict[str, Any]) -> StepError:
    """The exception for an `{"error": {"class", "message", "retry_after_ms"?}}` answer.

    A class this SDK does not know becomes `Unknown`, naming the class: stopping for review is
    the safe reading of a failure nobody can classify.
    """
    wire_class = error.get("class")
    message = str(error.get("message", ""))
    if wire_class == "temporary":
        retry_ms: Any = error.get("retry_after_ms")
        valid = (
            isinstance(retry_ms, (int, float))
            and not isinstance(retry_ms, bool)
            and math.isfinite(retry_ms)
            and retry_ms >= 0
        )
        return Temporary(message, retry_after=retry_ms / 1000 if valid else None)
    cls = _CLASSES.get(str(wire_class))
    if cls is None:
        return Unknown(f"an error of class {wire_class!r}: {message}")
    return cls(message)
