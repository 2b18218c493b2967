"""examples/chain.py in process, against the fake worker: what the Rust chain does, link by link.

The effect ledger's tests need Postgres (`TRAILMARK_TEST_PG`, default the local server); they
make a database of their own (tm_test_pychain_*) and drop it after.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from support import FakeWorker, endpoint, make_app, post_signed, step_call

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "chain.py"


@pytest.fixture(scope="module")
def chain() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pychain_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def no_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    # A kill spot armed in the environment would kill the test run itself.
    for name in ("PYCHAIN_KILL_AT", "PYCHAIN_FIXED", "DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)


async def link(
    chain: ModuleType, worker: FakeWorker, input: Any, position: int = 0, **fields: Any
) -> dict[str, Any]:
    """Runs one link (or, with `undo`, one unlink) and returns the endpoint's answer."""
    vars(chain)["ledger"] = chain.Ledger()  # its lock belongs to this test's event loop
    app = make_app([chain.wf], worker)
    token = worker.open()
    call = step_call(token, workflow="pychain", step="link", position=position, input=input)
    call.update(fields)
    async with endpoint(app) as client:
        answer = await post_signed(client, "/step", call)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def sha(content: str) -> str:
    return hashlib.sha256(json.dumps(content, ensure_ascii=False).encode()).hexdigest()


async def test_a_link_asks_the_model_and_writes_its_row_locally(chain: ModuleType) -> None:
    worker = FakeWorker(delay=0)
    answer = await link(chain, worker, {"steps": 3, "ledger": "local"}, position=1)
    payload = sha("answer to: Link 1 of 3 in run order-7.")
    assert answer == {"output": {"link": 1, "answer_sha256": payload}, "next": {"goto": "link"}}
    assert worker.ops() == ["model", "local-write"]
    assert worker.calls[0][1]["request"] == {
        "messages": [
            {"role": "system", "content": "You are one link of a chain. Answer briefly."},
            {"role": "user", "content": "Link 1 of 3 in run order-7."},
        ],
        "max_tokens": 64,
        "temperature": 0.0,
    }
    assert worker.calls[1][1]["table"] == "trailmark.chain_ledger"
    assert worker.local_rows == [
        {"reference": "order-7:1", "run_id": "order-7", "step": 1, "payload": payload}
    ]


async def test_the_last_link_finishes(chain: ModuleType) -> None:
    answer = await link(chain, FakeWorker(delay=0), {"steps": 3, "ledger": "local"}, position=2)
    assert answer["next"] == "finish" and "pause" not in answer


async def test_sleep_wait_and_children_pause_after_their_link(chain: ModuleType) -> None:
    local = {"steps": 3, "ledger": "local"}
    slept = await link(chain, FakeWorker(delay=0), {**local, "sleep": {"at": 0, "secs": 5}})
    assert slept["pause"] == {"sleep_secs": 5.0}

    wait = {"at": 0, "event": "go", "timeout_secs": 60}
    waited = await link(chain, FakeWorker(delay=0), {**local, "wait": wait})
    assert waited["pause"] == {"event": {"name": "go", "timeout_secs": 60.0}}
    worker = FakeWorker(delay=0)
    worker.event = {"id": "e1", "name": "go", "key": "order-7", "payload": {"ok": 1}}
    after = await link(chain, worker, {**local, "wait": wait}, position=1)
    assert after["output"]["event"] == {"id": "e1", "payload": {"ok": 1}}
    assert worker.ops() == ["model", "event", "local-write"]

    children = {"at": 0, "count": 2, "steps": 2, "fail": [1], "max_in_flight": 1}
    fanned = await link(chain, FakeWorker(delay=0), {**local, "children": children})
    assert fanned["pause"] == {
        "children": {
            "items": [
                {"workflow": "pychain", "input": {"steps": 2, "fail": False}},
                {"workflow": "pychain", "input": {"steps": 2, "fail": True}},
            ],
            "max_in_flight": 1,
        }
    }
    worker = FakeWorker(delay=0)
    worker.summary = {"succeeded": 1, "failed": 1}
    after = await link(chain, worker, {**local, "children": children}, position=1)
    assert after["output"]["children"] == {"succeeded": 1, "failed": 1}


async def test_children_inputs_carry_waits_slow_sleeps_and_grandchildren(chain: ModuleType) -> None:
    children = {
        "at": 0,
        "count": 3,
        "steps": 2,
        "slow": [2],
        "slow_secs": 10,
        "wait": {"at": 0, "event": "e", "timeout_secs": 5},
        "children": {"at": 0, "count": 1},
        "first": 2,
        "fail_threshold": 1,
    }
    answer = await link(
        chain, FakeWorker(delay=0), {"steps": 2, "ledger": "local", "children": children}
    )
    pause = answer["pause"]["children"]
    assert (pause["first"], pause["fail_threshold"], "max_in_flight" in pause) == (2, 1, False)
    grandchildren = {"at": 0, "count": 1, "steps": 1, "fail": [], "slow": [], "slow_secs": 3600.0}
    wait = {"at": 0, "event": "e", "timeout_secs": 5.0}
    assert pause["items"][0] == {
        "workflow": "pychain",
        "input": {"steps": 2, "fail": False, "wait": wait, "children": grandchildren},
    }
    assert pause["items"][2]["input"]["sleep"] == {"at": 0, "secs": 10.0}


async def test_a_failing_run_stops_at_its_first_link_until_fixed(
    chain: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = {"steps": 2, "ledger": "local", "fail": True}
    answer = await link(chain, FakeWorker(delay=0), failing)
    assert answer == {
        "error": {
            "class": "unknown",
            "message": "chain run order-7 was started with `fail`: its first link stops for review",
        }
    }
    monkeypatch.setenv("PYCHAIN_FIXED", "1")
    assert (await link(chain, FakeWorker(delay=0), failing))["next"] == {"goto": "link"}


@pytest.mark.parametrize(
    ("input", "says"),
    [
        ({"steps": 2, "colour": "red"}, "unknown field `colour`"),
        ({"steps": 0}, "`steps` must be from 1 to 1000000, got 0"),
        ({"steps": 2.5}, "`steps` must be an integer"),
        ({"step_delay_ms": 3_600_001}, "`step_delay_ms` must be at most 3600000"),
        ({"ledger": "paper"}, "`ledger`"),
        ({"steps": 3, "sleep": {"at": 2, "secs": 1}}, "`sleep.at` must be a link with a link"),
        ({"steps": 3, "sleep": {"at": 0, "secs": 0}}, "`sleep.secs` must be more than 0"),
        ({"steps": 3, "wait": {"at": 0, "event": "a b", "timeout_secs": 1}}, "`wait.event`"),
        (
            {
                "steps": 3,
                "sleep": {"at": 0, "secs": 1},
                "wait": {"at": 0, "event": "e", "timeout_secs": 1},
            },
            "a link can sleep or wait, not both",
        ),
        ({"steps": 3, "children": {"at": 0, "count": 2, "fail": [2]}}, "names child 2"),
        ({"steps": 3, "children": {"at": 0}}, "missing field `count`"),
    ],
)
async def test_a_bad_input_stops_for_review_saying_why(
    chain: ModuleType, input: dict[str, Any], says: str
) -> None:
    error = (await link(chain, FakeWorker(delay=0), input))["error"]
    assert error["class"] == "unknown"
    assert error["message"].startswith("chain input: ") and says in error["message"], error


async def test_unlink_posts_a_reversal_row(chain: ModuleType) -> None:
    worker = FakeWorker(delay=0)
    undo = {"step": "link", "position": 2, "output": {"link": 2}}
    answer = await link(chain, worker, {"steps": 3, "ledger": "local"}, position=5, undo=undo)
    result = {"reference": "undo:order-7:2", "with_commit": True}
    assert answer == {"output": {"reversed": 2, "ledger": result}, "next": "continue"}
    assert worker.local_rows == [
        {
            "reference": "undo:order-7:2",
            "run_id": "order-7",
            "step": 2,
            "payload": "reversal of order-7:2",
        }
    ]


async def test_the_effect_ledger_without_a_database_is_a_configuration_error(
    chain: ModuleType,
) -> None:
    error = (await link(chain, FakeWorker(delay=0), {"steps": 2}))["error"]
    assert error["class"] == "auth" and "DATABASE_URL" in error["message"]


# --- with Postgres --------------------------------------------------------------------------

LEDGER_DDL = """
CREATE SCHEMA trailmark;
CREATE TABLE trailmark.chain_ledger (
    reference TEXT PRIMARY KEY, run_id TEXT NOT NULL, step INTEGER NOT NULL,
    payload TEXT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
"""


@pytest.fixture
def database() -> Iterator[str]:
    base = os.environ.get("TRAILMARK_TEST_PG", "postgres://postgres@127.0.0.1:5432")
    name = f"tm_test_pychain_{secrets.token_hex(4)}"
    try:
        admin = psycopg.connect(f"{base}/postgres", autocommit=True, connect_timeout=3)
    except psycopg.Error as e:
        pytest.skip(f"no Postgres at {base} (set TRAILMARK_TEST_PG): {e}")
    with admin:
        admin.execute(f"CREATE DATABASE {name}")
        try:
            with psycopg.connect(f"{base}/{name}", autocommit=True) as conn:
                conn.execute(LEDGER_DDL)
            yield f"{base}/{name}"
        finally:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture
async def pg_chain(
    chain: ModuleType, database: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ModuleType]:
    monkeypatch.setenv("DATABASE_URL", database)
    yield chain
    await chain.ledger.close()


def rows(database: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(database) as conn:
        return conn.execute(
            "SELECT reference, run_id, step, payload FROM trailmark.chain_ledger ORDER BY reference"
        ).fetchall()


async def test_the_effect_ledger_writes_once_per_reference(
    pg_chain: ModuleType, database: str
) -> None:
    worker = FakeWorker(delay=0)
    answer = await link(pg_chain, worker, {"steps": 2}, position=0)
    payload = sha("answer to: Link 0 of 2 in run order-7.")
    assert answer["output"] == {"link": 0, "answer_sha256": payload}
    assert worker.ops() == ["model", "effect/begin", "effect/end"]
    begin, end = worker.calls[1][1], worker.calls[2][1]
    assert begin["key"] == "order-7:link:0"
    assert begin["request"] == {"reference": "order-7:0", "payload": payload}
    assert end["result"] == {"reference": "order-7:0", "created": True}
    assert rows(database) == [("order-7:0", "order-7", 0, payload)]

    # The worker lost the result (a crash between the insert and effect/end): the call is
    # made again with the same key, and the ledger's key makes it harmless.
    await pg_chain.ledger.close()
    again = FakeWorker(delay=0)
    await link(pg_chain, again, {"steps": 2}, position=0)
    assert again.calls[2][1]["result"] == {"reference": "order-7:0", "created": False}
    assert len(rows(database)) == 1


async def test_a_reference_holding_another_payload_is_a_conflict(
    pg_chain: ModuleType, database: str
) -> None:
    with psycopg.connect(database) as conn:
        conn.execute(
            "INSERT INTO trailmark.chain_ledger (reference, run_id, step, payload)"
            " VALUES ('order-7:0', 'order-7', 0, 'something else')"
        )
    error = (await link(pg_chain, FakeWorker(delay=0), {"steps": 2}))["error"]
    assert error == {
        "class": "conflict",
        "message": "chain ledger reference order-7:0 already holds a different payload; "
        "the write was not repeated",
    }


async def test_unlink_through_the_effect_ledger(pg_chain: ModuleType, database: str) -> None:
    worker = FakeWorker(delay=0)
    undo = {"step": "link", "position": 0, "output": {}}
    answer = await link(pg_chain, worker, {"steps": 2}, position=2, undo=undo)
    assert answer["output"] == {
        "reversed": 0,
        "ledger": {"reference": "undo:order-7:0", "created": True},
    }
    assert worker.calls[0][1]["key"] == "undo:order-7:link:0"
    assert rows(database) == [("undo:order-7:0", "order-7", 0, "reversal of order-7:0")]
