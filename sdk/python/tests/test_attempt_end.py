"""How an attempt ends: a refusal, a callback whose answer was lost, the deadline, a replay.

Each of these ends the attempt whatever the handler does afterwards: the worker has given up
on it, or a repeat would be paid twice.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from support import (
    CALLBACK_PREFIX,
    KEY,
    SECRET,
    FakeWorker,
    endpoint,
    make_app,
    one_step,
    post_signed,
    run,
    step_call,
)

from trailmark import App, AttemptRefused, Outcome, StepContext, Temporary, signing, user
from trailmark.app import SeenCalls

FENCED_OUT = (409, {"error": {"code": "fenced_out", "message": "stale fence"}})
REFUSED = {
    "error": {
        "class": "unknown",
        "message": "the attempt was refused by the worker: fenced_out: stale fence",
    }
}


# --- a refusal stays a refusal ------------------------------------------------------------


def test_attempt_refused_is_no_exception_a_generic_handler_catches() -> None:
    assert issubclass(AttemptRefused, BaseException)
    assert not issubclass(AttemptRefused, Exception)


async def test_except_exception_does_not_swallow_a_refusal() -> None:
    worker = FakeWorker()
    worker.forced["model"] = FENCED_OUT

    async def handler(ctx: StepContext) -> Outcome:
        try:
            await ctx.model([user("hi")])
        except Exception:  # the handler's own fallback: not for a refusal
            return Outcome.finish({"fallback": True})
        return Outcome.finish({})

    assert (await run(handler, worker)).json() == REFUSED


async def test_a_refusal_is_raised_again_by_every_later_callback_without_sending() -> None:
    worker = FakeWorker()
    worker.forced["model"] = FENCED_OUT
    again: list[AttemptRefused] = []

    async def handler(ctx: StepContext) -> Outcome:
        try:
            await ctx.model([user("hi")])
        except AttemptRefused:
            pass  # a handler that insists on going on
        for callback in (ctx.progress("x"), ctx.model([user("again")]), ctx.park("i", "r")):
            try:
                await callback
            except AttemptRefused as e:
                again.append(e)

        async def call(key: str) -> Any:
            raise AssertionError("an effect of a refused attempt must not call")

        try:
            await ctx.effect("k1", {}, call)
        except AttemptRefused as e:
            again.append(e)
        return Outcome.finish({"went on": True})

    answer = await run(handler, worker)
    assert answer.json() == REFUSED, "the answer is the refusal's, not the outcome returned"
    assert [e.code for e in again] == ["fenced_out"] * 4
    assert len(worker.answers) == 1, "nothing was sent after the refusal"


async def test_callbacks_waiting_for_the_lock_when_a_refusal_comes_are_not_sent() -> None:
    worker = FakeWorker()
    worker.forced["model"] = FENCED_OUT

    async def handler(ctx: StepContext) -> Outcome:
        results = await asyncio.gather(
            *(ctx.model([user(f"q{n}")]) for n in range(4)), return_exceptions=True
        )
        assert all(isinstance(r, AttemptRefused) for r in results), results
        return Outcome.finish({})

    assert (await run(handler, worker)).json() == REFUSED
    assert len(worker.answers) == 1


async def test_a_refusal_inside_a_task_group_is_the_answer() -> None:
    worker = FakeWorker()
    worker.forced["model"] = FENCED_OUT

    async def handler(ctx: StepContext) -> Outcome:
        async with asyncio.TaskGroup() as group:
            group.create_task(ctx.model([user("hi")]))
            group.create_task(asyncio.sleep(1))
        return Outcome.finish({})

    assert (await run(handler, worker)).json() == REFUSED


# --- a lost answer ends the attempt -------------------------------------------------------


class LoseAnswers(httpx.AsyncBaseTransport):
    """The way to the worker, losing the answer to `op` after the worker served (journaled) it."""

    def __init__(self, worker: FakeWorker, op: str, error: type[httpx.TransportError]) -> None:
        self._inner = httpx.ASGITransport(app=worker)
        self._op = op
        self._error = error

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if request.url.path.endswith(f"/{self._op}"):
            raise self._error("the answer was lost on the way", request=request)
        return response


def losing_app(handler: Any, worker: FakeWorker, op: str, error: Any) -> App:
    return App([one_step(handler)], secret=SECRET, transport=LoseAnswers(worker, op, error))


LOST_TAIL = (
    "; the attempt ends so that the callback is not repeated under another number; "
    "the worker retries the step"
)


@pytest.mark.parametrize(
    ("lose", "detail"),
    [
        ({"error": httpx.ReadTimeout}, "no answer within the attempt's deadline"),
        ({"error": httpx.RemoteProtocolError}, "RemoteProtocolError"),
        ({"forced": (503, {})}, "HTTP 503 instead of the op's answer"),
        ({"forced": (429, {})}, "HTTP 429 instead of the op's answer"),
    ],
)
async def test_a_callback_whose_answer_was_lost_is_not_repeated_under_a_new_number(
    lose: dict[str, Any], detail: str
) -> None:
    worker = FakeWorker()
    caught: list[BaseException] = []

    async def handler(ctx: StepContext) -> Outcome:
        try:
            await ctx.model([user("hi")])
        except Exception as e:  # a retry loop as handlers write them
            caught.append(e)
            await ctx.model([user("hi")])  # would pay the model a second time, as call 2
        return Outcome.finish({})

    if "forced" in lose:
        worker.forced["model"] = lose["forced"]
        app = make_app([one_step(handler)], worker)
    else:
        app = losing_app(handler, worker, "model", lose["error"])
    error = (await run(handler, worker, app=app)).json()["error"]
    assert caught == [], "the lost answer is not a catchable Exception"
    assert worker.ops() == ["model"], "the model was asked once"
    assert error["class"] == "temporary"
    assert error["message"].startswith("callback 1 (model) got no answer: ")
    assert detail in error["message"] and error["message"].endswith(LOST_TAIL)


async def test_a_lost_answer_is_sticky_and_wins_over_the_outcome() -> None:
    worker = FakeWorker()

    async def handler(ctx: StepContext) -> Outcome:
        await ctx.progress("first")
        try:
            await ctx.model([user("hi")])
        except AttemptRefused as e:
            assert e.code == "answer_lost"
        with pytest.raises(AttemptRefused):
            await ctx.progress("after")
        return Outcome.finish({})

    app = losing_app(handler, worker, "model", httpx.ReadError)
    error = (await run(handler, worker, app=app)).json()["error"]
    assert error["class"] == "temporary"
    assert error["message"].startswith("callback 2 (model) got no answer: ReadError")
    assert worker.ops() == ["progress", "model"]


async def test_a_lost_effect_end_ends_the_attempt() -> None:
    worker = FakeWorker()

    async def handler(ctx: StepContext) -> Outcome:
        async def call(key: str) -> Any:
            return {"id": 1}

        try:
            await ctx.effect("k1", {}, call)
        except Exception:
            return Outcome.finish({"fallback": True})
        return Outcome.finish({})

    app = losing_app(handler, worker, "effect/end", httpx.ReadTimeout)
    error = (await run(handler, worker, app=app)).json()["error"]
    assert error["class"] == "temporary"
    assert error["message"].startswith("callback 2 (effect/end) got no answer")
    assert worker.ops() == ["effect/begin", "effect/end"]


async def test_an_operation_error_answered_by_the_worker_stays_a_catchable_temporary() -> None:
    worker = FakeWorker()
    worker.forced["model"] = (200, {"error": {"class": "temporary", "message": "model 503"}})

    async def handler(ctx: StepContext) -> Outcome:
        try:
            await ctx.model([user("hi")])
        except Temporary:
            await ctx.progress("the model is down; going on without it")
        return Outcome.finish({"went on": True})

    answer = await run(handler, worker)
    assert answer.json() == {"output": {"went on": True}, "next": "finish"}
    assert worker.ops() == ["model", "progress"]


# --- an effect's own failure is reported in full --------------------------------------------


async def test_a_failed_effect_call_reports_its_retry_after() -> None:
    worker = FakeWorker()
    wire = {"class": "temporary", "message": "ledger busy", "retry_after_ms": 2500}

    async def handler(ctx: StepContext) -> Outcome:
        async def call(key: str) -> Any:
            raise Temporary("ledger busy", retry_after=2.5)

        await ctx.effect("k1", {}, call)
        return Outcome.finish({})

    answer = await run(handler, worker)
    assert worker.calls[1] == ("effect/end", {"fence": 7, "call": 2, "key": "k1", "error": wire})
    assert answer.json() == {"error": wire}


# --- the deadline -------------------------------------------------------------------------


async def test_a_handler_past_its_deadline_is_stopped_and_answered_temporary() -> None:
    stopped = asyncio.Event()

    async def handler(ctx: StepContext) -> Outcome:
        try:
            await asyncio.Event().wait()  # hangs: a call with no timeout of its own
        finally:
            stopped.set()
        return Outcome.finish({})

    async with asyncio.timeout(5):
        answer = await run(handler, deadline_ms=100)
    assert stopped.is_set()
    error = answer.json()["error"]
    assert error["class"] == "temporary"
    assert error["message"].startswith("the step's handler ran past its deadline (deadline_ms 100)")


async def test_an_effect_call_past_the_deadline_frees_the_attempts_lock() -> None:
    worker = FakeWorker()
    seen: dict[str, Any] = {}

    async def handler(ctx: StepContext) -> Outcome:
        seen["ctx"] = ctx

        async def call(key: str) -> Any:
            await asyncio.Event().wait()

        await ctx.effect("k1", {}, call)
        return Outcome.finish({})

    async with asyncio.timeout(5):
        answer = await run(handler, worker, deadline_ms=200)
    assert "ran past its deadline" in answer.json()["error"]["message"]
    assert not seen["ctx"]._callbacks.lock.locked()


async def test_a_timeout_error_of_the_handlers_own_is_not_the_deadline() -> None:
    async def handler(ctx: StepContext) -> Outcome:
        raise TimeoutError("the ledger did not answer")

    error = (await run(handler)).json()["error"]
    assert error == {"class": "unknown", "message": "TimeoutError: the ledger did not answer"}


async def test_a_callback_from_a_task_made_inside_an_effects_call_is_a_clear_error() -> None:
    async def handler(ctx: StepContext) -> Outcome:
        async def call(key: str) -> Any:
            await asyncio.create_task(ctx.progress("inside, from another task"))
            return {}

        await ctx.effect("k1", {}, call)
        return Outcome.finish({})

    async with asyncio.timeout(5):
        error = (await run(handler)).json()["error"]
    assert error["class"] == "unknown" and "inside an effect's call" in error["message"]


# --- a replayed step call -----------------------------------------------------------------


async def test_a_replayed_step_call_is_refused() -> None:
    worker = FakeWorker()
    ran: list[int] = []

    async def handler(ctx: StepContext) -> Outcome:
        ran.append(ctx.attempt)
        return Outcome.finish({})

    app = make_app([one_step(handler)], worker)
    body = json.dumps(step_call(worker.open())).encode()
    async with endpoint(app) as client:
        first = await post_signed(client, "/step", body)
        # The same bytes, freshly signed (a captured call re-sent within the signature's window).
        again = await post_signed(client, "/step", body)
        other = await post_signed(client, "/step", step_call(worker.open()))
    assert first.status_code == 200 and other.status_code == 200
    assert again.status_code == 409
    assert again.json() == {
        "error": {
            "code": "replayed",
            "message": "this step call was seen before (a replay): refused",
        }
    }
    assert ran == [1, 1]


def test_seen_calls_forget_after_the_window_and_keep_a_bound() -> None:
    now = [1000.0]
    seen = SeenCalls(window_secs=600, limit=3, clock=lambda: now[0])
    assert seen.first("a") and not seen.first("a")
    now[0] += 599
    assert not seen.first("a")
    now[0] += 2
    assert seen.first("a"), "forgotten once the window passed"
    for token in ("b", "c", "d"):
        assert seen.first(token)
    assert len(seen) == 3, "the oldest is dropped at the bound"
    assert seen.first("a") and not seen.first("d")


def test_seen_calls_prune_expired_entries_on_insert() -> None:
    now = [0.0]
    seen = SeenCalls(window_secs=10, limit=100, clock=lambda: now[0])
    for n in range(50):
        seen.first(f"t{n}")
    now[0] += 11
    seen.first("fresh")
    assert len(seen) == 1


# --- the callback URL is the attempt's ----------------------------------------------------


@pytest.mark.parametrize("trailing", ["", "/"])
async def test_callbacks_go_to_the_attempts_url_with_the_bearer_token(trailing: str) -> None:
    worker = FakeWorker()

    async def handler(ctx: StepContext) -> Outcome:
        await ctx.progress("x")
        await ctx.model([user("hi")])
        return Outcome.finish({})

    app = make_app([one_step(handler)], worker)
    token = worker.open()
    call = step_call(token)
    call["callback"]["url"] += trailing
    async with endpoint(app) as client:
        answer = await post_signed(client, "/step", call)
    assert answer.json() == {"output": {}, "next": "finish"}
    base = f"{CALLBACK_PREFIX}/attempts/{token}"
    assert [path for path, _, _ in worker.answers] == [f"{base}/progress", f"{base}/model"]


async def test_a_callback_signed_for_another_attempts_path_is_refused() -> None:
    # The fake worker checks what the real listener checks: the path's token is the bearer's.
    worker = FakeWorker()
    mine, other = worker.open(), worker.open()
    body = json.dumps({"fence": 7, "call": 1, "line": "x"}).encode()
    path = f"{CALLBACK_PREFIX}/attempts/{other}/progress"
    headers = {"authorization": f"Bearer {mine}", **signing.sign(KEY, "POST", path, body)}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=worker), base_url="http://worker.test"
    ) as client:
        answer = await client.post(path, content=body, headers=headers)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "unknown_attempt"
