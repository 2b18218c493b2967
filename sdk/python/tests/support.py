"""Test helpers: a fake worker (the callback side, as an ASGI app) and a signed step caller."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from trailmark import Outcome, StepContext, Workflow, signing
from trailmark.app import App

SECRET = "test-secret-that-is-long-enough-0123456789"
KEY = SECRET.encode()
WORKER = "http://worker.test"
CALLBACK_PREFIX = "/callbacks/v1"


def attempt_path(token: str) -> str:
    """The path of an attempt's callbacks, as the worker makes it: the token is in the (signed)
    path, so a callback signed for one attempt cannot be replayed into another."""
    return f"{CALLBACK_PREFIX}/attempts/{token}"


@dataclass
class Attempt:
    """One open attempt as the worker knows it."""

    fence: int
    next_call: int = 1
    effect_open: str | None = None


@dataclass
class FakeWorker:
    """The worker's callback side: refuses what the protocol says a worker refuses.

    It records every accepted callback as `(op, body)` in `calls`, and how many callbacks it
    served at once (`max_in_flight`), holding each for `delay` seconds so that overlap shows.
    """

    delay: float = 0.01
    attempts: dict[str, Attempt] = field(default_factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    effects: dict[str, Any] = field(default_factory=dict)
    local_rows: list[dict[str, Any]] = field(default_factory=list)
    event: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    forced: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    #: Every answer given, as (path, status, body): the schema test checks the fake with them.
    answers: list[tuple[str, int, Any]] = field(default_factory=list)

    def open(self, fence: int = 7) -> str:
        """Opens an attempt; returns its token."""
        token = secrets.token_hex(32)
        self.attempts[token] = Attempt(fence)
        return token

    def ops(self) -> list[str]:
        """The ops accepted, in order."""
        return [op for op, _ in self.calls]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["raw_path"].decode()
        status, answer = await self._serve(path, dict(_headers(scope)), body)
        self.answers.append((path, status, answer))
        payload = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _serve(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, Any]:
        reason = signing.refusal(
            KEY,
            headers.get("trailmark-timestamp"),
            headers.get("trailmark-signature"),
            "POST",
            [path],
            body,
        )
        if reason:
            return _refuse(401, "bad_signature", reason)
        # As the worker's listener: the token in the path and the bearer header must agree.
        bearer = headers.get("authorization", "").removeprefix("Bearer ")
        token, _, op = path.removeprefix(CALLBACK_PREFIX + "/attempts/").partition("/")
        attempt = self.attempts.get(token) if token == bearer else None
        if attempt is None:
            return _refuse(401, "unknown_attempt", "no open attempt has this token")
        try:
            call = json.loads(body)
        except ValueError:
            return _refuse(400, "bad_request", "not JSON")
        if call.get("fence") != attempt.fence:
            return _refuse(409, "fenced_out", f"fence {call.get('fence')} is not {attempt.fence}")
        if call.get("call") != attempt.next_call:
            return _refuse(409, "out_of_order", f"call {call.get('call')}, not {attempt.next_call}")
        if attempt.effect_open is not None and (
            op != "effect/end" or call.get("key") != attempt.effect_open
        ):
            return _refuse(400, "bad_request", f"only effect/end of {attempt.effect_open} now")
        attempt.next_call += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        self.calls.append((op, call))
        if op in self.forced:
            return self.forced[op]
        return 200, self._answer(op, call, attempt)

    def _answer(self, op: str, call: dict[str, Any], attempt: Attempt) -> Any:
        if op == "model":
            last = call["request"]["messages"][-1]["content"]
            answer = {
                "content": f"answer to: {last}",
                "model": "fake-model",
                "prompt_tokens": 12,
                "completion_tokens": 3,
                "cost": 0.001,
                "latency_ms": 5,
            }
            return {"answer": answer}
        if op == "effect/begin":
            if call["key"] in self.effects:
                return {"state": "done", "result": self.effects[call["key"]]}
            attempt.effect_open = call["key"]
            return {"state": "call"}
        if op == "effect/end":
            attempt.effect_open = None
            if "error" in call:
                return {"result": None}
            self.effects[call["key"]] = call["result"]
            return {"result": call["result"]}
        if op == "local-write":
            self.local_rows.append(call["row"])
        return {
            "patched": {"patched": True},
            "output": {"output": None},
            "event": {"event": self.event},
            "children": {"summary": self.summary},
        }.get(op, {})


def _refuse(status: int, code: str, message: str) -> tuple[int, Any]:
    return status, {"error": {"code": code, "message": message}}


def _headers(scope: Any) -> list[tuple[str, str]]:
    return [(k.decode().lower(), v.decode()) for k, v in scope["headers"]]


def make_app(workflows: list[Any], worker: FakeWorker, **kwargs: Any) -> App:
    """An App whose callbacks go to `worker`, in process."""
    return App(workflows, secret=SECRET, transport=httpx.ASGITransport(app=worker), **kwargs)


def endpoint(app: Any, **kwargs: Any) -> httpx.AsyncClient:
    """A client calling `app` in process, as a worker would."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, **kwargs), base_url="http://endpoint.test"
    )


def step_call(token: str, **fields: Any) -> dict[str, Any]:
    """A step call's body; `fields` override the defaults."""
    body: dict[str, Any] = {
        "protocol": "trailmark-step/1",
        "run_id": "order-7",
        "workflow": "wf",
        "version": 1,
        "step": "s",
        "position": 0,
        "attempt": 1,
        "fence": 7,
        "input": {},
        "journal": [],
        "undo": None,
        "callback": {"url": WORKER + attempt_path(token), "token": token},
        "deadline_ms": 30_000,
    }
    body.update(fields)
    return body


async def post_signed(
    client: httpx.AsyncClient, path: str, body: Any, *, sign_path: str | None = None
) -> httpx.Response:
    """POSTs `body` (JSON, or raw bytes) signed as the worker signs it."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = signing.sign(KEY, "POST", sign_path or path, raw)
    return await client.post(path, content=raw, headers=headers)


async def get_signed(client: httpx.AsyncClient, path: str) -> httpx.Response:
    """GETs `path` signed as the worker signs it."""
    return await client.get(path, headers=signing.sign(KEY, "GET", path, b""))


Handler = Callable[[StepContext], Awaitable[Outcome]]


def one_step(handler: Handler, undo: Handler | None = None) -> Workflow:
    """Workflow wf v1 of one step `s` (and its undo), with a local table app.rows."""
    wf = Workflow("wf", version=1)
    wf.local_table("app.rows", key="id", columns=["id", "v"])
    wf.step("s", kind="write")(handler)
    if undo is not None:
        wf.compensation("s", note="undoes s")(undo)
    return wf


async def run(
    handler: Handler,
    worker: FakeWorker | None = None,
    *,
    compensation: Handler | None = None,
    app: App | None = None,
    **fields: Any,
) -> httpx.Response:
    """Calls the step once, as a worker would; returns the endpoint's answer."""
    worker = worker or FakeWorker()
    app = app or make_app([one_step(handler, compensation)], worker)
    token = worker.open(fence=fields.get("fence", 7))
    async with endpoint(app) as client:
        return await post_signed(client, "/step", step_call(token, **fields))
