"""The manifest, routes and mounting."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest
from support import SECRET, FakeWorker, endpoint, get_signed, make_app

from trailmark import App, Outcome, StepContext, Workflow, signing


def chain_like() -> Workflow:
    wf = Workflow("pychain", version=1)
    wf.local_table("app.invoices", key="invoice_no", columns=["invoice_no", "amount"])

    @wf.step("link", kind="write", key_recipe="run_id:link:position")
    async def link(ctx: StepContext) -> Outcome:
        return Outcome.finish({})

    @wf.compensation("link", note="posts a reversal row undo:<reference> per link")
    async def unlink(ctx: StepContext) -> Outcome:
        return Outcome.next({})

    @wf.step("ask", kind="human")
    async def ask(ctx: StepContext) -> Outcome:
        return Outcome.wait({"question": "ok?"})

    return wf


async def test_the_manifest_lists_workflows_steps_and_local_tables() -> None:
    async with endpoint(make_app([chain_like()], FakeWorker())) as client:
        answer = await get_signed(client, "/manifest")
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {
        "protocol": "trailmark-step/1",
        "workflows": [
            {
                "name": "pychain",
                "version": 1,
                "steps": [
                    {
                        "name": "link",
                        "kind": "write",
                        "key_recipe": "run_id:link:position",
                        "compensation": "posts a reversal row undo:<reference> per link",
                    },
                    {"name": "ask", "kind": "human"},
                ],
                "local_tables": [
                    {
                        "name": "app.invoices",
                        "key": "invoice_no",
                        "columns": ["invoice_no", "amount"],
                    }
                ],
            }
        ],
    }


async def test_other_paths_are_404_json() -> None:
    async with endpoint(make_app([chain_like()], FakeWorker())) as client:
        for path in ("/nothing", "/step"):  # GET /step is not a route either
            answer = await get_signed(client, path)
            assert answer.status_code == 404
            assert answer.json()["error"]["code"] == "bad_request"


async def test_with_a_prefix_it_answers_under_it_only() -> None:
    app = make_app([chain_like()], FakeWorker(), prefix="/trailmark")
    async with endpoint(app) as client:
        assert (await get_signed(client, "/trailmark/manifest")).status_code == 200
        assert (await get_signed(client, "/manifest")).status_code == 404


async def test_mounted_it_answers_relative_to_the_mount() -> None:
    # As Starlette/FastAPI mount it: root_path is the mount, path the full path.
    app = make_app([chain_like()], FakeWorker())
    async with endpoint(app, root_path="/trailmark") as client:
        answer = await get_signed(client, "/trailmark/manifest")
        assert answer.status_code == 200, answer.text
        assert answer.json()["workflows"][0]["name"] == "pychain"


async def call_scope(app: App, scope: dict[str, Any]) -> tuple[int, bytes]:
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], sent[1]["body"]


async def test_an_older_style_mount_with_the_mount_cut_from_path_works_too() -> None:
    app = App([chain_like()], secret=SECRET)
    headers = signing.sign(SECRET.encode(), "GET", "/trailmark/manifest", b"")
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/manifest",
        "root_path": "/trailmark",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    status, _ = await call_scope(app, scope)
    assert status == 200


async def test_lifespan_makes_and_closes_the_shared_client() -> None:
    app = App([chain_like()], secret=SECRET)
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "lifespan.startup.complete":
            assert app._client is not None and not app._client.is_closed

    await app({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert app._client is None


def test_declarations_are_checked() -> None:
    wf = Workflow("wf")
    with pytest.raises(ValueError, match="kind"):
        wf.step("s", kind="sideways")
    with pytest.raises(ValueError, match="not a valid name"):
        wf.step("bad name", kind="read")
    with pytest.raises(ValueError, match="declare the step itself first"):
        wf.compensation("s", note="undo")
    with pytest.raises(ValueError, match="one of its columns"):
        wf.local_table("t", key="id", columns=["a"])
    with pytest.raises(ValueError, match="version"):
        Workflow("wf", version=0)
    with pytest.raises(ValueError, match="twice"):
        App([Workflow("wf"), Workflow("wf")], secret=SECRET)
