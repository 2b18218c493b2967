"""`StepContext`: what a step handler gets, and its callbacks to the worker.

Every side effect of a step (a model answer, an outside write, a local row, a progress line, a
parked item) goes through a callback, so that the worker journals and fences it as it does for
a step compiled into it. Callbacks of one attempt are numbered and sent one at a time: the
worker refuses a callback whose number is not the next one, and a retry of the step must make
the same callbacks in the same order.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from . import signing
from .errors import ANSWER_LOST, AttemptRefused, Auth, StepError, Temporary, Unknown, from_wire

if TYPE_CHECKING:
    from .workflow import Workflow

log = logging.getLogger("trailmark")

#: The statuses by which a worker refuses a callback, and so ends the attempt.
REFUSALS = frozenset({400, 401, 409, 410})

T = TypeVar("T")
Message = dict[str, str]

#: The attempt whose effect's `call` runs in this context. A ContextVar, not the current task:
#: tasks made inside the call copy the context, so a ctx callback from any of them is refused
#: too, instead of waiting for ever for the lock its own effect holds.
_EFFECT_CALL: ContextVar[Callbacks | None] = ContextVar("trailmark_effect_call", default=None)


def system(text: str) -> Message:
    """A system message for `ctx.model`."""
    return {"role": "system", "content": text}


def user(text: str) -> Message:
    """A user message for `ctx.model`."""
    return {"role": "user", "content": text}


def assistant(text: str) -> Message:
    """An assistant message for `ctx.model` (an earlier turn of the conversation)."""
    return {"role": "assistant", "content": text}


@dataclass(frozen=True)
class Answer:
    """A model's answer, as the worker journaled it (word for word, paid once)."""

    content: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cost: float
    latency_ms: int

    @classmethod
    def from_wire(cls, answer: Any) -> Answer:
        """The answer of a `model` callback; one without `content` is the worker's bug."""
        if not isinstance(answer, dict) or not isinstance(answer.get("content"), str):
            raise Unknown(f"the model callback answered no answer with a content: {answer!r:.200}")
        return cls(
            content=answer["content"],
            model=str(answer.get("model", "")),
            prompt_tokens=int(answer.get("prompt_tokens", 0)),
            completion_tokens=int(answer.get("completion_tokens", 0)),
            cost=float(answer.get("cost", 0.0)),
            latency_ms=int(answer.get("latency_ms", 0)),
        )


def encode(value: Any) -> bytes:
    """JSON bytes as the protocol carries them (NaN and infinities are not JSON: refused)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class Callbacks:
    """One attempt's channel to the worker: numbered, signed, one callback at a time.

    It ends with the attempt's first refusal or lost answer (`refused`): from then on every
    callback raises that `AttemptRefused` again without sending, since the worker would refuse
    it or, for a lost answer, take it as a new call and pay for it twice.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        key: bytes,
        url: str,
        token: str,
        fence: int,
        deadline: float,
    ) -> None:
        self._client = client
        self._key = key
        self._url = url.rstrip("/")
        self._token = token
        self._fence = fence
        self._deadline = deadline
        self._calls = 0
        # Held for a whole callback, and from effect/begin to effect/end: the worker serves an
        # attempt's callbacks one at a time, in order, and accepts nothing between those two.
        self.lock = asyncio.Lock()
        #: Why the attempt is over, once a callback was refused or its answer lost.
        self.refused: AttemptRefused | None = None

    async def call(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        """Sends one callback under the lock and returns the op's result."""
        self._refuse_reentry(op)
        self._check_open()
        async with self.lock:
            return await self.send(op, fields)

    async def send(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        """Sends one callback; the caller holds `lock`. A refusal is remembered (see the class)."""
        # Checked again under the lock: callbacks that waited for it behind a refused one.
        self._check_open()
        try:
            return await self._send(op, fields)
        except AttemptRefused as e:
            self.refused = e
            raise

    def _check_open(self) -> None:
        if self.refused is not None:
            raise self.refused

    async def _send(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        try:
            body = encode({"fence": self._fence, "call": self._calls + 1, **fields})
        except (TypeError, ValueError) as e:
            raise ValueError(f"the {op} callback's body cannot be encoded as JSON: {e}") from e
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise Temporary(f"the attempt's deadline passed before the {op} callback")
        # The number is spent once the callback may have reached the worker.
        self._calls += 1
        number = self._calls
        url = httpx.URL(f"{self._url}/{op}")
        path = url.raw_path.split(b"?", 1)[0].decode("ascii")
        headers = {
            "content-type": "application/json",
            "authorization": f"Bearer {self._token}",
            **signing.sign(self._key, "POST", path, body),
        }
        log.debug("callback %s (call %d)", op, number)
        try:
            response = await self._client.post(
                url, content=body, headers=headers, timeout=remaining
            )
        except httpx.TimeoutException as e:
            raise _lost(number, op, "no answer within the attempt's deadline") from e
        except httpx.TransportError as e:
            raise _lost(number, op, f"{type(e).__name__}: {e}") from e
        status = response.status_code
        if status == 429 or status >= 500:
            # Not the worker's answer to the op (a proxy's, or the worker failing): the op may
            # still have been done and journaled, so it counts as lost.
            raise _lost(number, op, f"HTTP {status} instead of the op's answer")
        return _result(op, response)

    def _refuse_reentry(self, op: str) -> None:
        # A callback from inside an effect's call would wait for the lock its own effect holds.
        if _EFFECT_CALL.get() is self:
            raise RuntimeError(
                f"ctx.{op.replace('-', '_')} was called inside an effect's call: between "
                "effect/begin and effect/end the worker accepts nothing else; call it before "
                "or after ctx.effect"
            )

    async def effect(
        self, key: str, request: dict[str, Any], call: Callable[[str], Awaitable[T]]
    ) -> Any:
        """effect/begin, the call when the worker says so, effect/end: all under the lock."""
        self._refuse_reentry("effect")
        self._check_open()
        async with self.lock:
            begun = await self.send("effect/begin", {"key": key, "request": request})
            state = begun.get("state")
            if state == "done":
                return begun.get("result")
            if state != "call":
                raise Unknown(f"effect/begin for {key} answered state {state!r}, not done or call")
            result = await self._make_call(key, call)
            ended = await self.send("effect/end", {"key": key, "result": result})
            return ended.get("result", result)

    async def _make_call(self, key: str, call: Callable[[str], Awaitable[T]]) -> T:
        """Runs the outside call; a failure is reported with effect/end, then raised."""
        try:
            result = await self._outside_call(key, call)
        except Exception as e:
            failure = e if isinstance(e, StepError) else Unknown(f"{type(e).__name__}: {e}")
            await self._report(key, failure)
            raise
        try:
            encode(result)
        except (TypeError, ValueError) as e:
            failure = Unknown(f"the result of effect {key} cannot be encoded as JSON: {e}")
            await self._report(key, failure)
            raise failure from e
        return result

    async def _outside_call(self, key: str, call: Callable[[str], Awaitable[T]]) -> T:
        """`call(key)`, marked as this attempt's effect call for `_refuse_reentry`."""
        inside = _EFFECT_CALL.set(self)
        try:
            return await call(key)
        finally:
            _EFFECT_CALL.reset(inside)

    async def _report(self, key: str, failure: StepError) -> None:
        # The error's whole wire form (a Temporary's retry_after_ms too): the worker records
        # it as the call's failure, and the step's own answer carries the same.
        try:
            await self.send("effect/end", {"key": key, "error": failure.to_wire()})
        except StepError:
            # A worker may answer a reported failure with the error itself: the failure the
            # handler sees stays the call's own. A refusal (AttemptRefused) still goes through.
            pass


def _lost(number: int, op: str, detail: str) -> AttemptRefused:
    """The end of an attempt whose callback `number` got no answer.

    The worker may have done the op (journaled and paid a model answer) before the answer was
    lost. The same op again would go out as number + 1, which the worker takes for a new call
    and pays again; number `number` again is refused as out of order. So the attempt ends,
    and the worker's retry of the step gets the answer from the journal.
    """
    return AttemptRefused(
        ANSWER_LOST,
        f"callback {number} ({op}) got no answer: {detail}; the attempt ends so that the "
        "callback is not repeated under another number; the worker retries the step",
    )


def _result(op: str, response: httpx.Response) -> dict[str, Any]:
    """The op's result from a callback's answer (not a 429 or 5xx), or the exception it stands
    for."""
    status = response.status_code
    if status == 200:
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise Unknown(f"the {op} callback answered 200 with a body that is not a JSON object")
        error = body.get("error")
        if isinstance(error, dict) and "class" in error:
            raise from_wire(error)
        return body
    if status in REFUSALS:
        code, message = _refusal(response)
        raise AttemptRefused(code, message)
    raise Auth(
        f"the {op} callback answered {status}: the worker's callback URL and this endpoint "
        "disagree; check remote.callback_url"
    )


def _refusal(response: httpx.Response) -> tuple[str, str]:
    try:
        error = response.json()["error"]
        return str(error["code"]), str(error.get("message", ""))
    except (ValueError, KeyError, TypeError):
        return f"http_{response.status_code}", response.text[:200]


class StepContext:
    """One attempt of one step: what the worker sent, and the callbacks to it.

    The attributes are the step call's fields: `run_id`, `workflow`, `version`, `step`,
    `position` (from 0), `attempt` (from 1), `fence`, `input`, `journal` (what earlier attempts
    of this position recorded; empty on a first attempt), `undo` (None, or the `step`,
    `position` and `output` of the step a compensation undoes) and `deadline` (a
    `time.monotonic()` value after which the worker no longer waits for the answer).
    """

    def __init__(
        self,
        *,
        definition: Workflow,
        call: dict[str, Any],
        callbacks: Callbacks,
        deadline: float,
    ) -> None:
        self.run_id: str = call["run_id"]
        self.workflow: str = call["workflow"]
        self.version: int = call["version"]
        self.step: str = call["step"]
        self.position: int = call["position"]
        self.attempt: int = call["attempt"]
        self.fence: int = call["fence"]
        self.input: Any = call["input"]
        self.journal: list[Any] = call["journal"]
        self.undo: dict[str, Any] | None = call["undo"]
        self.deadline_ms: int = call["deadline_ms"]
        self.deadline = deadline
        self._definition = definition
        self._callbacks = callbacks

    def __repr__(self) -> str:
        return (
            f"StepContext(run_id={self.run_id!r}, step={self.step!r}, "
            f"position={self.position}, attempt={self.attempt})"
        )

    def remaining(self) -> float:
        """Seconds left before the worker stops waiting for this attempt."""
        return max(0.0, self.deadline - time.monotonic())

    async def model(
        self,
        messages: list[Message],
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> Answer:
        """Asks the worker's model; on a later attempt the journal answers without a new call."""
        request: dict[str, Any] = {"messages": messages}
        if max_tokens is not None:
            request["max_tokens"] = max_tokens
        if temperature is not None:
            request["temperature"] = temperature
        answer = await self._callbacks.call("model", {"request": request})
        return Answer.from_wire(answer.get("answer"))

    async def effect(
        self, key: str, request: dict[str, Any], call: Callable[[str], Awaitable[Any]]
    ) -> Any:
        """An outside write made once per `key`: recorded before, its result after.

        `request` (a JSON object) describes the write; the worker records its hash with the key,
        and answers `conflict` when the key comes back with another request.
        When the worker already holds the result (an earlier attempt reported it), that result
        comes back and `call` is not called. Otherwise `await call(key)` makes the write (the
        receiver must enforce `key`: after a crash the call is made again with it) and its
        JSON result is recorded and returned. An exception from `call` is reported, then raised.
        """
        if not (isinstance(key, str) and 0 < len(key) <= 400 and all("!" <= c <= "~" for c in key)):
            raise ValueError(
                f"effect key {key!r:.80} is not one: use 1-400 printable ASCII characters, "
                "no spaces (the worker's idempotency-key rule)"
            )
        if not isinstance(request, dict):
            raise TypeError(f"the request of effect {key} must be a JSON object (a dict)")
        return await self._callbacks.effect(key, request, call)

    async def local_write(self, table: str, row: dict[str, Any]) -> None:
        """A row the worker inserts into the declared local table `table` with the step's commit."""
        declared = self._definition.local_tables.get(table)
        if declared is None:
            raise ValueError(
                f"local table {table} is not declared in workflow {self.workflow}: "
                "declare it with Workflow.local_table"
            )
        unknown = sorted(set(row) - set(declared.columns))
        if unknown or declared.key not in row:
            raise ValueError(
                f"a row of {table} has columns {', '.join(declared.columns)} and needs its key "
                f"{declared.key}; got {sorted(row)}"
            )
        await self._callbacks.call("local-write", {"table": table, "row": row})

    async def progress(self, line: str) -> None:
        """A progress line the run's watchers see while the step runs."""
        await self._callbacks.call("progress", {"line": line})

    async def park(self, item: str, reason: str) -> None:
        """Sets an item that cannot be done aside for a person, and lets the step go on.

        `item` names the item (an id, a line): the protocol carries it as a string.
        """
        if not isinstance(item, str):
            raise TypeError(f"park takes the item as a string (an id or a line), got {item!r:.60}")
        await self._callbacks.call("park", {"item": item, "reason": reason})

    async def patched(self, change: str) -> bool:
        """Whether this run takes the code path of `change` (journaled: a retry answers alike)."""
        answer = await self._callbacks.call("patched", {"change": change})
        return bool(answer.get("patched"))

    async def output_of(self, step: str) -> Any:
        """The latest output of `step` in this run, or None."""
        return (await self._callbacks.call("output", {"step": step})).get("output")

    async def event(self) -> dict[str, Any] | None:
        """The event the run's wait received (`id`, `name`, `key`, `payload`), or None."""
        return (await self._callbacks.call("event", {})).get("event")

    async def children_summary(self) -> dict[str, Any] | None:
        """How the children of the fan-out before this step ended, or None."""
        return (await self._callbacks.call("children", {})).get("summary")
