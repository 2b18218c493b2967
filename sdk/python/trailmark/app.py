"""`App`: the endpoint as a plain ASGI 3 application.

No framework: serve it with uvicorn as it is, or mount it in FastAPI or Starlette. It answers at
`/manifest` and `/step` relative to where it is mounted (and under `prefix`, when given).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import httpx

from . import signing
from .context import Callbacks, StepContext, encode
from .errors import AttemptRefused, StepError
from .outcome import Outcome
from .workflow import PROTOCOL, Handler, Workflow, manifest

log = logging.getLogger("trailmark")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: The largest request body read (a step call carries the run's input and journal).
MAX_BODY_BYTES = 64 * 1024 * 1024

#: How long a step call's token is remembered to refuse a replay: a signature is accepted while
#: its timestamp is within MAX_SKEW_SECS of this clock, so a call stamped that far ahead stays
#: replayable for twice that after it arrived (10 minutes).
REPLAY_WINDOW_SECS = 2 * signing.MAX_SKEW_SECS
#: At most this many tokens are remembered (about 20 MB); see `SeenCalls`.
MAX_SEEN_CALLS = 100_000


class BadCall(Exception):
    """A request this endpoint answers with a 4xx: a deploy mismatch, not a step failure.

    The code is `bad_signature`, `bad_request` (the protocol's refusal codes; a 404 names the
    missing workflow or step in its message) or `replayed` (a step call seen before).
    """

    def __init__(self, status: int, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def body(self) -> dict[str, Any]:
        """The `{"error": {"code", "message"}}` body the protocol's refusals share."""
        return {"error": {"code": self.code, "message": self.message}}


class SeenCalls:
    """The tokens of the step calls received in the last `window_secs`.

    The worker makes a new token for every attempt and never sends a call twice, so a second
    call with a token is a captured one replayed (its signature still valid): it is refused
    rather than run again. Memory is bounded: expired tokens are dropped on every insert, and
    at `limit` live tokens the oldest goes. Forgetting one early is a small loss: its replay
    could make no callback, since the worker forgets a token when its attempt ends.
    """

    def __init__(
        self,
        window_secs: float = REPLAY_WINDOW_SECS,
        limit: int = MAX_SEEN_CALLS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window_secs
        self._limit = limit
        self._clock = clock
        # Token -> when it is forgotten. One window for all, so insertion order is expiry
        # order: the expired entries are always the first ones.
        self._expiry: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._expiry)

    def first(self, token: str) -> bool:
        """Records `token`; False when it was already seen within the window (a replay)."""
        now = self._clock()
        self._forget_expired(now)
        if token in self._expiry:
            return False
        if len(self._expiry) >= self._limit:
            del self._expiry[next(iter(self._expiry))]
        self._expiry[token] = now + self._window
        return True

    def _forget_expired(self, now: float) -> None:
        expiry = self._expiry
        while expiry:
            oldest = next(iter(expiry))
            if expiry[oldest] > now:
                return
            del expiry[oldest]


class App:
    """The ASGI endpoint serving `workflows` to trailmark workers that share `secret`.

    `secret` (at least 32 bytes) signs and checks every request, both directions. `prefix`
    (e.g. "/trailmark") adds a path in front of the routes when the app is served by itself;
    mounted in a framework, the mount's path already does that. `transport` replaces the HTTP
    transport of the callbacks (tests use an `httpx.MockTransport` as the worker).

    The shared `httpx.AsyncClient` of the callbacks is made at lifespan startup and closed at
    shutdown; a framework that does not pass lifespan events to a mounted app can call
    `startup()` and `shutdown()` itself (without them the client is made on first use).
    """

    def __init__(
        self,
        workflows: Sequence[Workflow],
        secret: str | bytes,
        *,
        prefix: str = "",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._key = signing.check_secret(secret)
        self._workflows: dict[tuple[str, int], Workflow] = {}
        for wf in workflows:
            if (wf.name, wf.version) in self._workflows:
                raise ValueError(f"{wf!r} is given twice")
            self._workflows[(wf.name, wf.version)] = wf
        if prefix and (not prefix.startswith("/") or prefix.endswith("/")):
            raise ValueError(f"prefix {prefix!r} must start with / and not end with one")
        self.prefix = prefix
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._manifest = encode(manifest(list(self._workflows.values())))
        self._seen = SeenCalls()

    def __repr__(self) -> str:  # never shows the secret
        return f"App({list(self._workflows.values())!r}, prefix={self.prefix!r})"

    async def startup(self) -> None:
        """Makes the callbacks' shared HTTP client."""
        self._http_client()

    async def shutdown(self) -> None:
        """Closes the callbacks' shared HTTP client."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _http_client(self) -> httpx.AsyncClient:
        if self._client is None:
            # No cap on connections: each one carries one in-flight callback, and the worker
            # already bounds the attempts it runs at once; a pool wait would eat the deadline.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
            self._client = httpx.AsyncClient(transport=self._transport, limits=limits)
        return self._client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        else:  # a websocket: nothing is served over one
            await receive()
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:  # the server reports it and stops
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        method: str = scope["method"]
        try:
            body = await _read_body(receive)
            self._check_signature(scope, method, body)
            status, answer = await self._route(scope, body, started)
        except BadCall as e:
            status, answer = e.status, encode(e.body())
        await _respond(send, status, answer)

    async def _route(self, scope: Scope, body: bytes, started: float) -> tuple[int, bytes]:
        method, path = scope["method"], self._relative_path(scope)
        if method == "GET" and path == "/manifest":
            return 200, self._manifest
        if method == "POST" and path == "/step":
            return 200, await self._step(body, started)
        raise BadCall(
            404,
            f"this endpoint serves GET {self.prefix}/manifest and POST {self.prefix}/step "
            f"(relative to where it is mounted), not {method} {scope['path']}",
        )

    def _relative_path(self, scope: Scope) -> str | None:
        """The path after the mount point (root_path) and `prefix`; None when not under it."""
        path: str = scope["path"]
        root: str = scope.get("root_path", "")
        if root and _under(path, root):
            path = path[len(root) :]
        if self.prefix:
            if not _under(path, self.prefix):
                return None
            path = path[len(self.prefix) :]
        return path

    def _check_signature(self, scope: Scope, method: str, body: bytes) -> None:
        headers = _headers(scope)
        reason = signing.refusal(
            self._key,
            headers.get(signing.TIMESTAMP_HEADER),
            headers.get(signing.SIGNATURE_HEADER),
            method,
            _sent_paths(scope),
            body,
        )
        if reason is not None:
            log.warning("refused %s %s: %s", method, scope.get("path"), reason)
            raise BadCall(401, reason, code="bad_signature")

    async def _step(self, body: bytes, started: float) -> bytes:
        call = parse_step_call(body)
        self._refuse_replay(call)
        definition, handler = self._handler(call)
        deadline = started + call["deadline_ms"] / 1000
        callback = call["callback"]
        callbacks = Callbacks(
            self._http_client(),
            self._key,
            callback["url"],
            callback["token"],
            call["fence"],
            deadline,
        )
        ctx = StepContext(definition=definition, call=call, callbacks=callbacks, deadline=deadline)
        answer = await _run(handler, ctx, definition, callbacks)
        try:
            return encode(answer)
        except (TypeError, ValueError) as e:
            message = f"the step's output cannot be encoded as JSON: {type(e).__name__}: {e}"
            return encode({"error": {"class": "unknown", "message": message}})

    def _refuse_replay(self, call: dict[str, Any]) -> None:
        """A 409 for a step call whose token was seen before: a replay, not the worker's."""
        if not self._seen.first(call["callback"]["token"]):
            log.warning(
                "refused a replayed step call (run %s, step %s, attempt %s)",
                call["run_id"],
                call["step"],
                call["attempt"],
            )
            raise BadCall(
                409, "this step call was seen before (a replay): refused", code="replayed"
            )

    def _handler(self, call: dict[str, Any]) -> tuple[Workflow, Handler]:
        """The workflow and the handler (step, or compensation when `undo` is set) a call names."""
        name, version = call["workflow"], call["version"]
        definition = self._workflows.get((name, version))
        if definition is None:
            served = ", ".join(f"{n} v{v}" for n, v in self._workflows) or "none"
            raise BadCall(
                404,
                f"this endpoint serves no workflow {name} version {version} (it serves: {served})",
            )
        undo = call["undo"]
        step = undo["step"] if undo is not None else call["step"]
        declared = definition.steps.get(step)
        if declared is None:
            raise BadCall(
                404,
                f"workflow {name} version {version} has no step {step} "
                f"(it has: {', '.join(definition.steps) or 'none'})",
            )
        if undo is None:
            return definition, declared.handler
        if declared.compensation is None:
            raise BadCall(
                404,
                f"step {step} of workflow {name} version {version} has no compensation",
            )
        return definition, declared.compensation


class _PastDeadline(Exception):
    """The handler was stopped at the attempt's deadline (see `_until_deadline`)."""


async def _run(
    handler: Handler, ctx: StepContext, definition: Workflow, callbacks: Callbacks
) -> dict[str, Any]:
    """The answer to one attempt: the handler's outcome, or its failure as an error class.

    Once a callback was refused or lost its answer, the answer is that end whatever the
    handler made of it afterwards (caught it, went on, returned an outcome).
    """
    where = f"step {ctx.step} of run {ctx.run_id} (position {ctx.position}, attempt {ctx.attempt})"
    try:
        answer = await _answer(handler, ctx, definition, where)
    except BaseExceptionGroup as group:
        # A task group (asyncio.TaskGroup) wraps a refusal with its siblings' failures, in a
        # BaseExceptionGroup since AttemptRefused is no Exception: the refusal's answer below.
        if callbacks.refused is None or group.subgroup(AttemptRefused) is None:
            raise
        answer = {}
    refused = callbacks.refused
    if refused is None:
        return answer
    if answer.get("error") != refused.to_wire():
        log.warning("%s: the attempt ended at a callback (%s); its answer is that", where, refused)
    return {"error": refused.to_wire()}


async def _answer(
    handler: Handler, ctx: StepContext, definition: Workflow, where: str
) -> dict[str, Any]:
    """The handler's outcome on the wire, or its failure as an error class."""
    try:
        outcome = await _until_deadline(handler, ctx)
    except _PastDeadline:
        log.warning("%s ran past its deadline (%d ms) and was stopped", where, ctx.deadline_ms)
        message = (
            f"the step's handler ran past its deadline (deadline_ms {ctx.deadline_ms}) and was "
            "stopped; the worker has given up on this attempt and retries the step"
        )
        return {"error": {"class": "temporary", "message": message}}
    except StepError as e:
        log.info("%s ended with a %s error: %s", where, e.wire_class, e.message)
        return {"error": e.to_wire()}
    except AttemptRefused as e:
        log.warning("%s: the attempt ended at a callback (%s); its work is void", where, e)
        return {"error": e.to_wire()}
    except Exception as e:  # any other failure stops the run for review, with its traceback logged
        log.exception("%s raised", where)
        return _unknown(f"{type(e).__name__}: {e}")
    if not isinstance(outcome, Outcome):
        return _unknown(f"the handler of {where} returned {type(outcome).__name__}, not an Outcome")
    target = outcome.then.get("goto") if isinstance(outcome.then, dict) else None
    if target is not None and target not in definition.steps:
        return _unknown(f"{where} goes to step {target}, which workflow {definition.name} lacks")
    return outcome.to_wire()


async def _until_deadline(handler: Handler, ctx: StepContext) -> Outcome:
    """The handler's outcome; `_PastDeadline` when it runs past the attempt's deadline.

    The worker stops waiting at the deadline (the attempt is void, its token revoked), so the
    handler is cancelled there: that frees the attempt's lock and task instead of letting them
    run on for nothing. A TimeoutError of the handler's own, before the deadline, goes through
    as any other exception.
    """
    limit = asyncio.timeout(ctx.remaining())
    try:
        async with limit:
            outcome = await handler(ctx)
    except TimeoutError as e:
        if limit.expired():
            raise _PastDeadline from e
        raise
    if limit.expired():  # the handler swallowed the cancellation and returned after it
        raise _PastDeadline
    return outcome


def _unknown(message: str) -> dict[str, Any]:
    return {"error": {"class": "unknown", "message": message}}


def _field(call: dict[str, Any], name: str, kind: type, low: int | None = None) -> Any:
    """`call[name]` when it is a `kind` (at least `low`), else a 400 naming the field."""
    value: Any = call.get(name)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok or (low is not None and call[name] < low):
        need = f" >= {low}" if low is not None else ""
        message = f"the step call's `{name}` is missing or not a {kind.__name__}{need}"
        raise BadCall(400, message)
    return value


def parse_step_call(body: bytes) -> dict[str, Any]:
    """The checked fields of a `POST /step` body; a 400 names the first that is wrong.

    Unknown fields are ignored (a newer worker may send more); `journal` and `undo` may be
    left out (as empty and null).
    """
    try:
        call = json.loads(body)
    except ValueError as e:
        raise BadCall(400, f"the step call's body is not JSON: {e}") from e
    if not isinstance(call, dict):
        raise BadCall(400, "the step call's body is not a JSON object")
    if call.get("protocol") != PROTOCOL:
        raise BadCall(
            400,
            f"this endpoint speaks {PROTOCOL}; the call says {call.get('protocol')!r}",
        )
    for name in ("run_id", "workflow", "step"):
        _field(call, name, str)
    _field(call, "version", int)
    _field(call, "position", int, 0)
    _field(call, "attempt", int, 1)
    _field(call, "fence", int)
    _field(call, "deadline_ms", int, 1)
    if "input" not in call:
        raise BadCall(400, "the step call has no `input`")
    call.setdefault("journal", [])
    _field(call, "journal", list)
    call["undo"] = _undo(call.get("undo"))
    _callback(call)
    return call


def _undo(undo: Any) -> dict[str, Any] | None:
    if undo is None:
        return None
    if not isinstance(undo, dict):
        raise BadCall(400, "the step call's `undo` is neither null nor an object")
    _field(undo, "step", str)
    _field(undo, "position", int, 0)
    undo.setdefault("output", None)
    return undo


def _callback(call: dict[str, Any]) -> None:
    callback = _field(call, "callback", dict)
    token = callback.get("token")
    if not isinstance(token, str) or not token:
        raise BadCall(400, "the step call's `callback.token` is missing")
    try:
        url = httpx.URL(callback.get("url", ""))
    except (httpx.InvalidURL, TypeError) as e:
        raise BadCall(400, f"the step call's `callback.url` is not a URL: {e}") from e
    if url.scheme not in ("http", "https") or not url.host:
        raise BadCall(400, "the step call's `callback.url` must be an http(s) URL")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _sent_paths(scope: Scope) -> list[str]:
    """The spellings of the request's path as sent that a signature may cover.

    The raw path is what the worker signed; root_path + path is the same path rebuilt, for a
    server that gives no raw path or a proxy that strips the mount before it. Both lead to the
    same route, so accepting either keeps the route signed.
    """
    paths: list[str] = []
    raw = scope.get("raw_path")
    if raw:
        paths.append(raw.split(b"?", 1)[0].decode("latin-1"))
    path, root = scope["path"], scope.get("root_path", "")
    full = path if not root or _under(path, root) else root + path
    if full not in paths:
        paths.append(full)
    return paths


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadCall(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
