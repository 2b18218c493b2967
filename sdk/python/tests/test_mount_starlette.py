"""Mounted in Starlette (what FastAPI's `mount` is): skipped when Starlette is not installed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from support import FakeWorker, endpoint, get_signed, make_app, post_signed, step_call

from trailmark import Outcome, StepContext, Workflow

starlette_applications = pytest.importorskip("starlette.applications")
starlette_routing = pytest.importorskip("starlette.routing")


async def test_a_mounted_app_answers_under_the_mount_with_signed_full_paths() -> None:
    wf = Workflow("wf")

    @wf.step("s", kind="read")
    async def s(ctx: StepContext) -> Outcome:
        await ctx.progress("mounted")
        return Outcome.finish({"ok": True})

    worker = FakeWorker(delay=0)
    trailmark = make_app([wf], worker)

    @asynccontextmanager
    async def lifespan(app: object) -> AsyncIterator[None]:
        # Starlette does not pass lifespan events to mounted apps: the host app does it.
        await trailmark.startup()
        yield
        await trailmark.shutdown()

    host = starlette_applications.Starlette(
        routes=[starlette_routing.Mount("/trailmark", app=trailmark)], lifespan=lifespan
    )
    async with endpoint(host) as client:
        assert (await get_signed(client, "/trailmark/manifest")).status_code == 200
        assert (await client.get("/trailmark/manifest")).status_code == 401
        answer = await post_signed(client, "/trailmark/step", step_call(worker.open()))
        assert answer.json() == {"output": {"ok": True}, "next": "finish"}
        # Signed for the path relative to the mount: not what was sent, refused.
        relative = await post_signed(
            client, "/trailmark/step", step_call(worker.open()), sign_path="/step"
        )
        assert relative.status_code == 401
