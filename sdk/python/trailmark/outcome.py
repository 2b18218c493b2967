"""What a step handler returns: its output, the step after it, and what the run waits for.

The checks here are the ones that need nothing but the values (positive durations, valid
names); the worker checks the rest (declared steps, `waits.max_secs`) when the answer arrives.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Self

# Event and step names as the worker checks them: 1-200 characters from A-Z a-z 0-9 . _ : -
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,200}")
_CONTINUE, _FINISH, _WAIT = "continue", "finish", "wait"


def _positive_secs(what: str, secs: float) -> float:
    if isinstance(secs, bool) or not isinstance(secs, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {type(secs).__name__}")
    if not (math.isfinite(secs) and secs > 0):
        raise ValueError(f"{what} must be more than 0 seconds, got {secs}")
    return secs


def _count(what: str, n: int | None, low: int, high: int | None = None) -> int | None:
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{what} must be an integer, got {type(n).__name__}")
    if n < low or (high is not None and n > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{what} must be {bound}, got {n}")
    return n


@dataclass(frozen=True)
class Children:
    """Child runs a step starts, and when its run goes on.

    `items` are `(workflow, input)` pairs, started in that order by the step's commit (each with
    run id `<parent>:<position>:<index>`). The run goes on once every child (or the `first` n)
    succeeded, with at most `fail_threshold` failed: an `int` is a count, a `float` a share of
    the children (0 to 1). `max_in_flight` bounds how many run at once.
    """

    items: list[tuple[str, Any]]
    max_in_flight: int | None = None
    first: int | None = None
    fail_threshold: int | float | None = None

    def __post_init__(self) -> None:
        for index, item in enumerate(self.items):
            if not (
                isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
            ):
                raise TypeError(f"child {index} must be a (workflow, input) pair, got {item!r}")
        total = len(self.items)
        _count("max_in_flight", self.max_in_flight, 1)
        _count("first", self.first, 1, total)
        self._check_threshold(total)

    def _check_threshold(self, total: int) -> None:
        f = self.fail_threshold
        if f is None:
            return
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise TypeError(
                f"fail_threshold must be an int (a count) or a float (a share), got {f!r}"
            )
        if isinstance(f, int):
            _count("fail_threshold (a count)", f, 0, total)
        elif not (math.isfinite(f) and 0.0 <= f <= 1.0):
            raise ValueError(f"fail_threshold as a share must be from 0 to 1, got {f}")

    def to_wire(self) -> dict[str, Any]:
        """The pause's `{"children": ...}` object."""
        wire: dict[str, Any] = {
            "items": [{"workflow": w, "input": i} for w, i in self.items],
        }
        for name in ("max_in_flight", "first", "fail_threshold"):
            if getattr(self, name) is not None:
                wire[name] = getattr(self, name)
        return {"children": wire}


@dataclass(frozen=True)
class Outcome:
    """A step's successful end: build one with `next`, `goto`, `finish` or `wait`.

    A pause (`sleep_for`, `sleep_until`, `wait_for_event`, `with_children`) returns a new
    outcome that waits before its next step; only `next` and `goto` outcomes take one.
    """

    output: Any
    then: str | dict[str, str]
    pause: dict[str, Any] | None = field(default=None)

    @classmethod
    def next(cls, output: Any) -> Outcome:
        """Output, then the next declared step."""
        return cls(output, _CONTINUE)

    @classmethod
    def goto(cls, output: Any, step: str) -> Outcome:
        """Output, then the declared step `step`."""
        if not isinstance(step, str) or not step:
            raise ValueError(f"goto needs a step name, got {step!r}")
        return cls(output, {"goto": step})

    @classmethod
    def finish(cls, output: Any) -> Outcome:
        """Output, and the run is done."""
        return cls(output, _FINISH)

    @classmethod
    def wait(cls, question: Any) -> Outcome:
        """A human step's question: the run waits until a person approves or rejects it."""
        return cls(question, _WAIT)

    def sleep_for(self, secs: float) -> Self:
        """Sleeps `secs` seconds (more than 0) from the step's commit before the next step."""
        return self._paused({"sleep_secs": _positive_secs("sleep_for", secs)})

    def sleep_until(self, when: datetime) -> Self:
        """Sleeps until `when` (timezone-aware) before the next step."""
        if not isinstance(when, datetime) or when.tzinfo is None or when.utcoffset() is None:
            raise ValueError(
                "sleep_until needs a timezone-aware datetime, e.g. datetime.now(timezone.utc)"
            )
        utc = when.astimezone(UTC).isoformat().replace("+00:00", "Z")
        return self._paused({"sleep_until": utc})

    def wait_for_event(
        self,
        name: str,
        timeout_secs: float,
        key: str | None = None,
        on_timeout_goto: str | None = None,
    ) -> Self:
        """Waits for the event `name` keyed `key` (default: the run id), `timeout_secs` at most.

        On timeout the run stops for review, or goes on with `on_timeout_goto` when given.
        """
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"event name {name!r} is not one: use 1-200 characters from A-Z a-z 0-9 . _ : -"
            )
        event: dict[str, Any] = {
            "name": name,
            "timeout_secs": _positive_secs("timeout_secs", timeout_secs),
        }
        if key is not None:
            if not key or len(key) > 200 or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in key):
                raise ValueError(
                    f"event key {key!r} must be 1-200 characters without control characters"
                )
            event["key"] = key
        if on_timeout_goto is not None:
            if not isinstance(on_timeout_goto, str) or not _NAME.fullmatch(on_timeout_goto):
                raise ValueError(f"on_timeout_goto {on_timeout_goto!r} is not a step name")
            event["on_timeout_goto"] = on_timeout_goto
        return self._paused({"event": event})

    def with_children(self, children: Children) -> Self:
        """Starts `children` with the step's commit and waits for them before the next step."""
        if not isinstance(children, Children):
            raise TypeError("with_children takes a Children")
        return self._paused(children.to_wire())

    def _paused(self, pause: dict[str, Any]) -> Self:
        if self.then in (_FINISH, _WAIT):
            raise ValueError(
                f"a `{self.then}` outcome cannot pause: only next and goto outcomes wait before "
                "their next step"
            )
        return replace(self, pause=pause)

    def to_wire(self) -> dict[str, Any]:
        """The step call's answer body for this outcome."""
        wire: dict[str, Any] = {"output": self.output, "next": self.then}
        if self.pause is not None:
            wire["pause"] = self.pause
        return wire
