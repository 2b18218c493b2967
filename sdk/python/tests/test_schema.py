"""What the SDK sends and answers, checked against the protocol's machine-readable form.

`sdk/protocol/trailmark-step-v1.openapi.json` holds both sides' bodies as JSON Schemas; every
body the SDK produces in the scenarios below must match its schema. The fake worker's answers
and the step calls the tests send are checked too, so that the other tests test the real thing.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from support import (
    CALLBACK_PREFIX,
    FakeWorker,
    endpoint,
    get_signed,
    make_app,
    post_signed,
    step_call,
)

from trailmark import Children, Conflict, Outcome, StepContext, Temporary, Workflow, user

SPEC = Path(__file__).resolve().parents[2] / "protocol" / "trailmark-step-v1.openapi.json"
URN = "urn:trailmark-step-v1"

pytestmark = pytest.mark.skipif(not SPEC.exists(), reason=f"{SPEC} is absent")


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(SPEC.read_text())
    return doc


@pytest.fixture(scope="module")
def registry(spec: dict[str, Any]) -> Registry[Any]:
    resource: Resource[Any] = DRAFT202012.create_resource(spec)
    registry: Registry[Any] = Registry().with_resource(URN, resource)
    return registry


def check(registry: Registry[Any], pointer: str, body: Any) -> None:
    """Validates `body` against the schema at `pointer` (a JSON pointer into the spec)."""
    schema = {"$ref": f"{URN}#{pointer}"}
    validator = Draft202012Validator(
        schema, registry=registry, format_checker=Draft202012Validator.FORMAT_CHECKER
    )
    errors = sorted(validator.iter_errors(body), key=str)
    assert not errors, f"{json.dumps(body)[:300]} does not match {pointer}: {errors[0].message}"


def schema_of(name: str) -> str:
    return f"/components/schemas/{name}"


def op_pointer(path: str, part: str) -> str:
    """The pointer to a callback's request body schema or its 200 answer's schema."""
    escaped = path.replace("~", "~0").replace("/", "~1")
    if part == "request":
        return f"/paths/{escaped}/post/requestBody/content/application~1json/schema"
    return f"/paths/{escaped}/post/responses/200/content/application~1json/schema"


def busy_workflow() -> Workflow:
    """One step per outcome kind, and a step that makes every callback."""
    wf = Workflow("wf", version=1)
    wf.local_table("app.rows", key="id", columns=["id", "v"])
    outcomes = {
        "next": Outcome.next({"a": 1}),
        "finish": Outcome.finish([1, 2]),
        "ask": Outcome.wait({"question": "ok?"}),
        "goto": Outcome.goto(None, "next"),
        "sleep": Outcome.next(1).sleep_for(2.5),
        "until": Outcome.next(1).sleep_until(datetime(2026, 12, 24, 9, tzinfo=UTC)),
        "event": Outcome.goto(1, "next").wait_for_event("po.reply", 60, "PO-1", "finish"),
        "fan": Outcome.next(1).with_children(
            Children([("wf", {"n": 1}), ("wf", {})], max_in_flight=1, first=1, fail_threshold=0.5)
        ),
    }
    for name, outcome in outcomes.items():

        async def handler(ctx: StepContext, outcome: Outcome = outcome) -> Outcome:
            return outcome

        wf.step(name, kind="human" if name == "ask" else "read")(handler)

    @wf.step("calls", kind="write", key_recipe="run_id:calls")
    async def calls(ctx: StepContext) -> Outcome:
        await ctx.model([user("hi")], max_tokens=5, temperature=0.2)

        async def made(key: str) -> Any:
            return {"id": key}

        async def fails(key: str) -> Any:
            raise Conflict("already there")

        await ctx.effect("k:1", {"amount": 1}, made)
        await ctx.effect("k:1", {"amount": 1}, made)  # done: begin only
        try:
            await ctx.effect("k:2", {"amount": 2}, fails)
        except Conflict:
            pass
        await ctx.local_write("app.rows", {"id": "r", "v": 1})
        await ctx.progress("half way")
        await ctx.park("line 3", "no price")
        await ctx.patched("prompt-2")
        await ctx.output_of("next")
        await ctx.event()
        await ctx.children_summary()
        raise Temporary("try later", retry_after=1.5)

    @wf.compensation("calls", note="undoes calls")
    async def undo(ctx: StepContext) -> Outcome:
        return Outcome.next({"undone": True})

    return wf


async def test_the_sdk_bodies_match_the_protocol_schemas(registry: Registry[Any]) -> None:
    worker = FakeWorker(delay=0)
    worker.event = {"id": "e1", "name": "go", "key": "order-7", "payload": {}}
    worker.summary = {
        "total": 1,
        "pending": 0,
        "running": 0,
        "succeeded": 1,
        "failed": 0,
        "skipped": 0,
    }
    wf = busy_workflow()
    app = make_app([wf], worker)
    async with endpoint(app) as client:
        check(registry, schema_of("Manifest"), (await get_signed(client, "/manifest")).json())
        for step in wf.steps:
            call = step_call(worker.open(), step=step)
            check(registry, schema_of("StepCall"), call)
            answer = await post_signed(client, "/step", call)
            assert answer.status_code == 200
            check(registry, schema_of("StepAnswer"), answer.json())
        undo = {"step": "calls", "position": 0, "output": None}
        call = step_call(worker.open(), step="undo:calls@0", undo=undo)
        check(registry, schema_of("StepCall"), call)
        check(registry, schema_of("StepAnswer"), (await post_signed(client, "/step", call)).json())

        unknown = await post_signed(client, "/step", step_call(worker.open(), workflow="nope"))
        assert unknown.status_code == 404
        check(registry, schema_of("Refusal"), unknown.json())
        unsigned = await client.get("/manifest")
        check(registry, schema_of("Refusal"), unsigned.json())

    seen = set()
    for (op, body), (path, status, answer) in zip(worker.calls, worker.answers, strict=True):
        # Sent to `{callback.url}/{op}`, the url being the attempt's, as the spec's paths say.
        assert path.startswith(f"{CALLBACK_PREFIX}/attempts/") and path.endswith(f"/{op}")
        assert status == 200
        spec_path = f"{CALLBACK_PREFIX}/attempts/{{token}}/{op}"
        check(registry, op_pointer(spec_path, "request"), body)
        check(registry, op_pointer(spec_path, "response"), answer)
        seen.add(op)
    assert seen == {
        "model",
        "effect/begin",
        "effect/end",
        "local-write",
        "progress",
        "park",
        "patched",
        "output",
        "event",
        "children",
    }
