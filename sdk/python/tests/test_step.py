"""One attempt end to end: the step call, the handler, its callbacks to a fake worker."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from support import (
    SECRET,
    FakeWorker,
    endpoint,
    make_app,
    one_step,
    post_signed,
    run,
    step_call,
)

from trailmark import (
    App,
    AttemptRefused,
    Auth,
    Conflict,
    Outcome,
    StepContext,
    Temporary,
    Unknown,
    system,
    user,
)


async def test_the_context_carries_the_call_and_the_outcome_comes_back() -> None:
    seen: dict[str, Any] = {}

    async def handler(ctx: StepContext) -> Outcome:
        seen.update(vars(ctx))
        return Outcome.goto({"link": ctx.position}, "s").sleep_for(30)

    journal = [{"call": 1, "kind": "model", "request_hash": "h", "response": {"content": "x"}}]
    answer = await run(handler, position=3, attempt=2, input={"steps": 10}, journal=journal)
    assert answer.status_code == 200
    assert answer.json() == {
        "output": {"link": 3},
        "next": {"goto": "s"},
        "pause": {"sleep_secs": 30},
    }
    assert (seen["run_id"], seen["workflow"], seen["version"], seen["step"]) == (
        "order-7",
        "wf",
        1,
        "s",
    )
    assert (seen["position"], seen["attempt"], seen["fence"]) == (3, 2, 7)
    assert seen["input"] == {"steps": 10} and seen["journal"] == journal and seen["undo"] is None


@pytest.mark.parametrize(
    ("error", "wire"),
    [
        (
            Temporary("search API 503", retry_after=2),
            {"class": "temporary", "message": "search API 503", "retry_after_ms": 2000},
        ),
        (Temporary("later"), {"class": "temporary", "message": "later"}),
        (Unknown("look at it"), {"class": "unknown", "message": "look at it"}),
        (Conflict("key reused"), {"class": "conflict", "message": "key reused"}),
        (Auth("bad credentials"), {"class": "auth", "message": "bad credentials"}),
    ],
)
async def test_step_errors_answer_their_class(error: Exception, wire: dict[str, Any]) -> None:
    async def handler(ctx: StepContext) -> Outcome:
        raise error

    answer = await run(handler)
    assert answer.status_code == 200
    assert answer.json() == {"error": wire}


async def test_an_uncaught_exception_is_unknown_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(ctx: StepContext) -> Outcome:
        raise KeyError("price")

    with caplog.at_level(logging.ERROR, logger="trailmark"):
        answer = await run(handler)
    assert answer.json() == {"error": {"class": "unknown", "message": "KeyError: 'price'"}}
    assert any(r.exc_info for r in caplog.records), "the traceback is logged"


async def test_output_json_cannot_encode_is_unknown() -> None:
    async def handler(ctx: StepContext) -> Outcome:
        return Outcome.next({"when": object()})

    error = (await run(handler)).json()["error"]
    assert error["class"] == "unknown" and "cannot be encoded as JSON" in error["message"]

    async def nan(ctx: StepContext) -> Outcome:
        return Outcome.next(float("nan"))

    assert "JSON" in (await run(nan)).json()["error"]["message"]


async def test_a_handler_that_returns_no_outcome_or_an_undeclared_goto_is_unknown() -> None:
    async def nothing(ctx: StepContext) -> Outcome:
        return None  # type: ignore[return-value]

    assert "not an Outcome" in (await run(nothing)).json()["error"]["message"]

    async def lost(ctx: StepContext) -> Outcome:
        return Outcome.goto({}, "nowhere")

    assert "nowhere" in (await run(lost)).json()["error"]["message"]


async def test_unknown_workflow_version_or_step_is_404_naming_them() -> None:
    async def handler(ctx: StepContext) -> Outcome:
        return Outcome.finish({})

    for fields, named in (
        ({"workflow": "other"}, "no workflow other version 1"),
        ({"version": 2}, "no workflow wf version 2"),
        ({"step": "t"}, "has no step t"),
        ({"undo": {"step": "s", "position": 0, "output": {}}}, "has no compensation"),
    ):
        answer = await run(handler, **fields)
        assert answer.status_code == 404, fields
        assert named in answer.json()["error"]["message"]


async def test_a_bad_protocol_or_body_is_400() -> None:
    async def handler(ctx: StepContext) -> Outcome:
        return Outcome.finish({})

    assert (await run(handler, protocol="trailmark-step/2")).status_code == 400
    answer = await run(handler, position=-1)
    assert answer.status_code == 400 and "position" in answer.json()["error"]["message"]
    answer = await run(handler, callback={"url": "ftp://x", "token": "t"})
    assert answer.status_code == 400


async def test_undo_runs_the_compensation_with_its_target() -> None:
    async def step(ctx: StepContext) -> Outcome:
        raise AssertionError("the step itself must not run")

    async def undo(ctx: StepContext) -> Outcome:
        assert ctx.undo is not None
        return Outcome.next({"reversed": ctx.undo["position"], "of": ctx.undo["output"]})

    target = {"step": "s", "position": 4, "output": {"link": 4}}
    answer = await run(step, compensation=undo, step="undo:s@4", position=9, undo=target)
    assert answer.json() == {"output": {"reversed": 4, "of": {"link": 4}}, "next": "continue"}


async def test_callbacks_are_numbered_signed_and_sent_one_at_a_time() -> None:
    worker = FakeWorker(delay=0.02)

    async def handler(ctx: StepContext) -> Outcome:
        answers = await asyncio.gather(
            *(ctx.model([system("be brief"), user(f"q{n}")], max_tokens=8) for n in range(5))
        )
        await ctx.progress("done asking")
        return Outcome.finish([a.content for a in answers])

    answer = await run(handler, worker)
    assert answer.json() == {"output": [f"answer to: q{n}" for n in range(5)], "next": "finish"}
    assert [body["call"] for _, body in worker.calls] == [1, 2, 3, 4, 5, 6]
    assert worker.max_in_flight == 1
    assert all(body["fence"] == 7 for _, body in worker.calls)
    first = worker.calls[0][1]
    assert first["request"] == {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q0"}],
        "max_tokens": 8,
    }


async def test_model_answers_are_read_into_an_answer() -> None:
    async def handler(ctx: StepContext) -> Outcome:
        a = await ctx.model([user("hi")], temperature=0.0)
        return Outcome.finish(
            [a.content, a.model, a.prompt_tokens, a.completion_tokens, a.cost, a.latency_ms]
        )

    answer = await run(handler)
    assert answer.json()["output"] == ["answer to: hi", "fake-model", 12, 3, 0.001, 5]


async def test_effect_done_returns_the_recorded_result_without_calling() -> None:
    worker = FakeWorker()
    worker.effects["k1"] = {"id": "recorded"}
    called: list[str] = []

    async def handler(ctx: StepContext) -> Outcome:
        async def call(key: str) -> Any:
            called.append(key)
            return {"id": "new"}

        return Outcome.finish(await ctx.effect("k1", {"amount": 3}, call))

    answer = await run(handler, worker)
    assert answer.json()["output"] == {"id": "recorded"}
    assert called == [] and worker.ops() == ["effect/begin"]


async def test_effect_call_then_end_records_and_returns_the_result() -> None:
    worker = FakeWorker()

    async def handler(ctx: StepContext) -> Outcome:
        async def call(key: str) -> Any:
            await asyncio.sleep(0.02)
            return {"id": f"made with {key}"}

        # A callback asked for while the effect is open waits for its end.
        result, _ = await asyncio.gather(ctx.effect("k1", {"amount": 3}, call), ctx.progress("p"))
        return Outcome.finish(result)

    answer = await run(handler, worker)
    assert answer.json()["output"] == {"id": "made with k1"}
    assert worker.ops() in (
        ["effect/begin", "effect/end", "progress"],
        ["progress", "effect/begin", "effect/end"],
    )
    begin = worker.calls[worker.ops().index("effect/begin")][1]
    assert begin["key"] == "k1" and begin["request"] == {"amount": 3}
    assert worker.effects == {"k1": {"id": "made with k1"}}


@pytest.mark.parametrize(
    ("raised", "wire_class", "message"),
    [
        (Conflict("duplicate order"), "conflict", "duplicate order"),
        (RuntimeError("socket closed"), "unknown", "RuntimeError: socket closed"),
    ],
)
async def test_a_failed_effect_call_is_reported_then_raised(
    raised: Exception, wire_class: str, message: str
) -> None:
    worker = FakeWorker()

    async def handler(ctx: StepContext) -> Outcome:
        async def call(key: str) -> Any:
            raise raised

        await ctx.effect("k1", {}, call)
        return Outcome.finish({})

    answer = await run(handler, worker)
    assert answer.json() == {"error": {"class": wire_class, "message": message}}
    assert worker.ops() == ["effect/begin", "effect/end"]
    assert worker.calls[1][1]["error"] == {"class": wire_class, "message": message}


async def test_a_callback_inside_an_effect_call_is_a_clear_error() -> None:
    async def handler(ctx: StepContext) -> Outcome:
        async def call(key: str) -> Any:
            await ctx.progress("inside")
            return {}

        await ctx.effect("k1", {}, call)
        return Outcome.finish({})

    error = (await run(handler)).json()["error"]
    assert error["class"] == "unknown" and "inside an effect's call" in error["message"]


async def test_a_refused_callback_raises_attempt_refused_and_voids_the_attempt() -> None:
    worker = FakeWorker()
    worker.forced["model"] = (409, {"error": {"code": "fenced_out", "message": "stale fence"}})
    seen: list[AttemptRefused] = []

    async def handler(ctx: StepContext) -> Outcome:
        try:
            await ctx.model([user("hi")])
        except AttemptRefused as e:
            seen.append(e)
            raise
        return Outcome.finish({})

    answer = await run(handler, worker)
    assert seen[0].code == "fenced_out"
    assert answer.json() == {
        "error": {
            "class": "unknown",
            "message": "the attempt was refused by the worker: fenced_out: stale fence",
        }
    }


async def test_a_real_refusal_from_the_worker_for_a_wrong_fence() -> None:
    worker = FakeWorker()

    async def handler(ctx: StepContext) -> Outcome:
        await ctx.progress("x")
        return Outcome.finish({})

    app = make_app([one_step(handler)], worker)
    token = worker.open(fence=8)  # the worker's lease moved on: fence 8, the call says 7
    async with endpoint(app) as client:
        answer = await post_signed(client, "/step", step_call(token, fence=7))
    assert "fenced_out" in answer.json()["error"]["message"]


async def test_an_operation_error_raises_its_class_with_retry_after() -> None:
    worker = FakeWorker()
    error = {"class": "temporary", "message": "model 503", "retry_after_ms": 1500}
    worker.forced["model"] = (200, {"error": error})
    caught: list[Temporary] = []

    async def handler(ctx: StepContext) -> Outcome:
        try:
            await ctx.model([user("hi")])
        except Temporary as e:
            caught.append(e)
            raise
        return Outcome.finish({})

    answer = await run(handler, worker)
    assert caught[0].retry_after == 1.5
    assert answer.json() == {"error": error}


async def test_an_unreachable_worker_is_temporary() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def handler(ctx: StepContext) -> Outcome:
        await ctx.progress("x")
        return Outcome.finish({})

    app = App([one_step(handler)], secret=SECRET, transport=httpx.MockTransport(refuse))
    error = (await run(handler, app=app)).json()["error"]
    # Handled as a lost answer (the SDK does not tell the two apart): the attempt ends.
    assert error["class"] == "temporary"
    assert error["message"].startswith("callback 1 (progress) got no answer: ConnectError")


async def test_a_callback_after_the_deadline_is_temporary() -> None:
    async def handler(ctx: StepContext) -> Outcome:
        await asyncio.sleep(0.05)
        await ctx.progress("too late")
        return Outcome.finish({})

    error = (await run(handler, deadline_ms=10)).json()["error"]
    assert error["class"] == "temporary" and "deadline" in error["message"]


async def test_small_callbacks_send_their_fields() -> None:
    worker = FakeWorker()
    worker.event = {"id": "e1", "name": "go", "key": "order-7", "payload": {"ok": True}}
    worker.summary = {"succeeded": 2, "failed": 0}

    async def handler(ctx: StepContext) -> Outcome:
        await ctx.local_write("app.rows", {"id": "r1", "v": 2})
        await ctx.park("line 4", "no price")
        patched = await ctx.patched("prompt-2")
        before = await ctx.output_of("s")
        event = await ctx.event()
        summary = await ctx.children_summary()
        return Outcome.finish([patched, before, event, summary])

    answer = await run(handler, worker)
    assert answer.json()["output"] == [True, None, worker.event, worker.summary]
    bodies = {
        op: {k: v for k, v in body.items() if k not in ("fence", "call")}
        for op, body in worker.calls
    }
    assert bodies == {
        "local-write": {"table": "app.rows", "row": {"id": "r1", "v": 2}},
        "park": {"item": "line 4", "reason": "no price"},
        "patched": {"change": "prompt-2"},
        "output": {"step": "s"},
        "event": {},
        "children": {},
    }


async def test_a_local_write_to_an_undeclared_table_is_refused_before_sending() -> None:
    worker = FakeWorker()

    async def handler(ctx: StepContext) -> Outcome:
        await ctx.local_write("app.other", {"id": 1})
        return Outcome.finish({})

    error = (await run(handler, worker)).json()["error"]
    assert "not declared" in error["message"] and worker.calls == []


async def test_an_effect_key_the_worker_would_refuse_is_refused_before_sending() -> None:
    worker = FakeWorker()

    async def handler(ctx: StepContext) -> Outcome:
        async def call(key: str) -> Any:
            return {}

        await ctx.effect("has a space", {}, call)
        return Outcome.finish({})

    error = (await run(handler, worker)).json()["error"]
    assert "printable ASCII" in error["message"] and worker.calls == []
