"""pychain: the Rust `chain` test workflow, written with the Python SDK.

N links, each one journaled model call and one keyed write into `trailmark.chain_ledger`, with
optional sleeps, event waits and fan-outs after a named link: the same behaviour as
`crates/testkit/src/chain.rs`, so the engine's tests can drive a remote workflow as they drive
the built-in one.

    TRAILMARK_SECRET=... DATABASE_URL=postgres://... \\
        python sdk/python/examples/chain.py --host 127.0.0.1 --port 8001 --prefix /trailmark

Environment: `TRAILMARK_SECRET` (required, at least 32 bytes), `DATABASE_URL` (Postgres, for
the effect ledger; read on first use), `PYCHAIN_NAME` (the workflow's name, default `pychain`),
`PYCHAIN_FIXED=1` (the deployed fix of `fail` runs), `PYCHAIN_PROMPT` (a changed prompt: a
changed build for the replay check), and for crash tests `PYCHAIN_KILL_AT=<spot>`
(`after_model`, `after_begin`, `after_insert`, `before_answer`) with `PYCHAIN_KILL_ONCE=<file>`
(kill only while that file does not exist; it is made just before the kill).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
import uvicorn
from psycopg_pool import AsyncConnectionPool

from trailmark import (
    App,
    Auth,
    Children,
    Conflict,
    Outcome,
    StepContext,
    Temporary,
    Unknown,
    Workflow,
    system,
    user,
)

NAME = os.environ.get("PYCHAIN_NAME", "pychain")
STEP = "link"
TABLE = "trailmark.chain_ledger"
#: The longest sleep or timeout accepted (the default `waits.max_secs`, 366 days).
LONGEST_WAIT_SECS = 31_622_400.0
#: The link's prompt. `PYCHAIN_PROMPT` replaces it: a changed build, which the replay check
#: must catch before it is deployed.
PROMPT = os.environ.get("PYCHAIN_PROMPT", "You are one link of a chain. Answer briefly.")

wf = Workflow(NAME, version=1)
wf.local_table(TABLE, key="reference", columns=["reference", "run_id", "step", "payload"])


# --- the input ----------------------------------------------------------------------------


class BadInput(Exception):
    """Why a run's input is not a chain input (the run stops for review with it)."""


_MISSING = object()
T = TypeVar("T")


def _obj(raw: Any, where: str, fields: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise BadInput(f"{where} must be an object, got {json.dumps(raw)}")
    for name in raw:
        if name not in fields:
            expected = ", ".join(f"`{f}`" for f in fields)
            raise BadInput(f"unknown field `{name}` in {where}, expected one of {expected}")
    return raw


def _int(obj: dict[str, Any], name: str, default: Any = _MISSING, low: int | None = None) -> int:
    value = obj.get(name, default)
    if value is _MISSING:
        raise BadInput(f"missing field `{name}`")
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        least = f" of at least {low}" if low is not None else ""
        raise BadInput(f"`{name}` must be an integer{least}, got {json.dumps(value)}")
    return value


def _secs(obj: dict[str, Any], name: str, default: Any = _MISSING) -> float:
    value = obj.get(name, default)
    if value is _MISSING:
        raise BadInput(f"missing field `{name}`")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"`{name}` must be a number, got {json.dumps(value)}")
    return float(value)


def _count_or_none(obj: dict[str, Any], name: str) -> int | None:
    return None if obj.get(name) is None else _int(obj, name, low=0)


def _indexes(obj: dict[str, Any], name: str) -> list[int]:
    value = obj.get(name, [])
    if not isinstance(value, list):
        raise BadInput(f"`{name}` must be a list of child indexes, got {json.dumps(value)}")
    return [_int({name: v}, name, low=0) for v in value]


@dataclass(frozen=True)
class SleepAt:
    """After link `at` the run sleeps `secs` seconds."""

    at: int
    secs: float

    @classmethod
    def parse(cls, raw: Any) -> SleepAt:
        obj = _obj(raw, "`sleep`", ("at", "secs"))
        return cls(_int(obj, "at"), _secs(obj, "secs"))


@dataclass(frozen=True)
class WaitAt:
    """After link `at` the run waits for `event` keyed by the run's id, `timeout_secs` at most."""

    at: int
    event: str
    timeout_secs: float

    @classmethod
    def parse(cls, raw: Any) -> WaitAt:
        obj = _obj(raw, "`wait`", ("at", "event", "timeout_secs"))
        event = obj.get("event")
        if not isinstance(event, str):
            raise BadInput(f"`event` must be a string, got {json.dumps(event)}")
        return cls(_int(obj, "at"), event, _secs(obj, "timeout_secs"))

    def wire(self) -> dict[str, Any]:
        return {"at": self.at, "event": self.event, "timeout_secs": self.timeout_secs}


_CHILDREN_FIELDS = (
    "at",
    "count",
    "steps",
    "max_in_flight",
    "fail_threshold",
    "fail",
    "first",
    "wait",
    "slow",
    "slow_secs",
    "children",
)


@dataclass(frozen=True)
class ChildrenAt:
    """After link `at` the run starts `count` child chains of `steps` links and waits for them."""

    at: int
    count: int
    steps: int = 1
    max_in_flight: int | None = None
    fail_threshold: int | float | None = None
    fail: list[int] = field(default_factory=list)
    first: int | None = None
    wait: WaitAt | None = None
    slow: list[int] = field(default_factory=list)
    slow_secs: float = 3600.0
    children: ChildrenAt | None = None

    @classmethod
    def parse(cls, raw: Any) -> ChildrenAt:
        obj = _obj(raw, "`children`", _CHILDREN_FIELDS)
        threshold = obj.get("fail_threshold")
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, (int, float))
        ):
            raise BadInput(f"`fail_threshold` must be a number, got {json.dumps(threshold)}")
        return cls(
            at=_int(obj, "at"),
            count=_int(obj, "count", low=0),
            steps=_int(obj, "steps", 1),
            max_in_flight=_count_or_none(obj, "max_in_flight"),
            fail_threshold=threshold,
            fail=_indexes(obj, "fail"),
            first=_count_or_none(obj, "first"),
            wait=_optional(obj, "wait", WaitAt.parse),
            slow=_indexes(obj, "slow"),
            slow_secs=_secs(obj, "slow_secs", 3600.0),
            children=_optional(obj, "children", ChildrenAt.parse),
        )

    def input(self) -> dict[str, Any]:
        """As a run's input names it (what a child that fans out in turn is started with)."""
        wire: dict[str, Any] = {
            "at": self.at,
            "count": self.count,
            "steps": self.steps,
            "fail": self.fail,
            "slow": self.slow,
            "slow_secs": self.slow_secs,
        }
        optional = {
            "max_in_flight": self.max_in_flight,
            "first": self.first,
            "fail_threshold": self.fail_threshold,
            "children": self.children.input() if self.children else None,
            "wait": self.wait.wire() if self.wait else None,
        }
        wire.update({k: v for k, v in optional.items() if v is not None})
        return wire

    def pause(self) -> Children:
        """The fan-out this asks for."""
        return Children(
            items=[(NAME, self._child_input(i)) for i in range(self.count)],
            max_in_flight=self.max_in_flight,
            first=self.first,
            fail_threshold=self.fail_threshold,
        )

    def _child_input(self, index: int) -> dict[str, Any]:
        child: dict[str, Any] = {"steps": self.steps, "fail": index in self.fail}
        if self.wait is not None:
            child["wait"] = self.wait.wire()
        if index in self.slow:
            child["sleep"] = {"at": 0, "secs": self.slow_secs}
        if self.children is not None:
            child["children"] = self.children.input()
        return child


def _optional(obj: dict[str, Any], name: str, parse: Callable[[Any], T]) -> T | None:
    value = obj.get(name)
    return None if value is None else parse(value)


@dataclass(frozen=True)
class Params:
    """A checked chain input: `{"steps", "step_delay_ms", "ledger", "sleep", "wait", ...}`."""

    steps: int
    step_delay_ms: int
    ledger: str
    sleep: SleepAt | None
    wait: WaitAt | None
    children: ChildrenAt | None
    fail: bool

    @classmethod
    def parse(cls, raw: Any) -> Params:
        """The run's input, checked as the Rust chain checks it, or `Unknown("chain input: …")`."""
        try:
            params = cls._read(raw)
            params._check()
        except BadInput as e:
            raise Unknown(f"chain input: {e}") from None
        return params

    @classmethod
    def _read(cls, raw: Any) -> Params:
        fields = ("steps", "step_delay_ms", "ledger", "sleep", "wait", "children", "fail")
        obj = _obj(raw, "the input", fields)
        ledger = obj.get("ledger", "effect")
        if ledger not in ("effect", "local"):
            raise BadInput(
                f"unknown variant {json.dumps(ledger)} of `ledger`, expected `effect` or `local`"
            )
        fail = obj.get("fail", False)
        if not isinstance(fail, bool):
            raise BadInput(f"`fail` must be true or false, got {json.dumps(fail)}")
        return cls(
            steps=_int(obj, "steps", 10),
            step_delay_ms=_int(obj, "step_delay_ms", 0, low=0),
            ledger=ledger,
            sleep=_optional(obj, "sleep", SleepAt.parse),
            wait=_optional(obj, "wait", WaitAt.parse),
            children=_optional(obj, "children", ChildrenAt.parse),
            fail=fail,
        )

    def _check(self) -> None:
        if not 1 <= self.steps <= 1_000_000:
            raise BadInput(f"`steps` must be from 1 to 1000000, got {self.steps}")
        if self.step_delay_ms > 3_600_000:
            raise BadInput(
                f"`step_delay_ms` must be at most 3600000 (an hour), got {self.step_delay_ms}"
            )
        if self.sleep is not None:
            self._pause_at("sleep.at", self.sleep.at)
            _span("sleep.secs", self.sleep.secs)
        if self.wait is not None:
            self._check_wait(self.wait)
        if self.children is not None:
            self._check_children(self.children)

    def _check_wait(self, wait: WaitAt) -> None:
        self._pause_at("wait.at", wait.at)
        _span("wait.timeout_secs", wait.timeout_secs)
        if not (
            1 <= len(wait.event) <= 200
            and all(c.isascii() and (c.isalnum() or c in "._:-") for c in wait.event)
        ):
            raise BadInput(
                f"`wait.event`: {wait.event[:60]!r} is not one: use 1-200 characters from "
                "A-Z a-z 0-9 . _ : - (e.g. supplier.reply)"
            )
        if self.sleep is not None and self.sleep.at == wait.at:
            raise BadInput(
                f"`sleep.at` and `wait.at` are both {wait.at}: a link can sleep or wait, not both"
            )

    def _check_children(self, c: ChildrenAt) -> None:
        self._pause_at("children.at", c.at)
        paused = {p.at for p in (self.sleep, self.wait) if p is not None}
        if c.at in paused:
            raise BadInput(
                f"`children.at` is {c.at}, where the run already sleeps or waits: a link does one"
            )
        if not 1 <= c.steps <= 1_000_000:
            raise BadInput(f"`children.steps` must be from 1 to 1000000, got {c.steps}")
        bad = next((i for i in c.fail if i >= c.count), None)
        if bad is not None:
            raise BadInput(
                f"`children.fail` names child {bad}, but there are {c.count} "
                f"(0 to {max(c.count - 1, 0)})"
            )

    def _pause_at(self, name: str, at: int) -> None:
        """A link after which the run pauses must have a link after it."""
        if not 0 <= at < self.steps - 1:
            raise BadInput(
                f"`{name}` must be a link with a link after it, from 0 to {self.steps - 2} "
                f"(steps - 2), got {at}"
            )


def _span(name: str, secs: float) -> None:
    if not 0 < secs <= LONGEST_WAIT_SECS:
        raise BadInput(
            f"`{name}` must be more than 0 and at most {LONGEST_WAIT_SECS:.15g} (366 days), "
            f"got {secs:.15g}"
        )


# --- the ledger ---------------------------------------------------------------------------


class Ledger:
    """`trailmark.chain_ledger` in Postgres: its primary key on `reference` enforces the key."""

    def __init__(self) -> None:
        self._pool: AsyncConnectionPool | None = None
        self._opening = asyncio.Lock()

    async def pool(self) -> AsyncConnectionPool:
        """The connection pool, opened on first use (serving the manifest needs no database)."""
        async with self._opening:
            if self._pool is None:
                url = os.environ.get("DATABASE_URL")
                if not url:
                    raise Auth(
                        "DATABASE_URL is not set: pychain's effect ledger writes to Postgres"
                    )
                pool = AsyncConnectionPool(
                    url, min_size=1, max_size=8, timeout=10, open=False, kwargs={"autocommit": True}
                )
                await pool.open()
                self._pool = pool
            return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    async def post(self, run_id: str, step: int, reference: str, payload: str) -> dict[str, Any]:
        """Posts one row; the same reference with the same payload counts as already done."""
        pool = await self.pool()
        try:
            async with pool.connection() as conn:
                cur = await conn.execute(
                    "INSERT INTO trailmark.chain_ledger (reference, run_id, step, payload)"
                    " VALUES (%s, %s, %s, %s) ON CONFLICT (reference) DO NOTHING",
                    (reference, run_id, step, payload),
                )
                inserted = cur.rowcount == 1
                stored = None if inserted else await self._payload(conn, reference)
        except psycopg.Error as e:
            raise Temporary(f"chain ledger write {reference}: {e}") from e
        if not inserted:
            if stored is None:
                raise Temporary(f"chain ledger read {reference}: the row is gone")
            if stored != payload:
                raise Conflict(
                    f"chain ledger reference {reference} already holds a different payload; "
                    "the write was not repeated"
                )
        return {"reference": reference, "created": inserted}

    @staticmethod
    async def _payload(conn: psycopg.AsyncConnection[Any], reference: str) -> str | None:
        cur = await conn.execute(
            "SELECT payload FROM trailmark.chain_ledger WHERE reference = %s", (reference,)
        )
        row = await cur.fetchone()
        return None if row is None else str(row[0])


ledger = Ledger()


# --- crash spots --------------------------------------------------------------------------


def kill_at(spot: str) -> None:
    """Dies here (SIGKILL, nothing cleaned up) when `PYCHAIN_KILL_AT` names this spot.

    With `PYCHAIN_KILL_ONCE=<file>` only while the file does not exist (it is made first), so
    the restarted process goes on.
    """
    if os.environ.get("PYCHAIN_KILL_AT") != spot:
        return
    once = os.environ.get("PYCHAIN_KILL_ONCE")
    if once:
        try:
            with open(once, "x"):
                pass
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)


# --- the steps ----------------------------------------------------------------------------


def reference(run_id: str, seq: int) -> str:
    """The ledger reference of link `seq` (its reversal is `undo:<reference>`)."""
    return f"{run_id}:{seq}"


def link_key(run_id: str, seq: int) -> str:
    """The key of link `seq`'s ledger write (its compensation writes under `undo:` + it)."""
    return f"{run_id}:{STEP}:{seq}"


@wf.step(STEP, kind="write", key_recipe="run_id:link:position")
async def link(ctx: StepContext) -> Outcome:
    """One link: a model call, its answer's hash written to the ledger, then the next link."""
    p = Params.parse(ctx.input)
    i = ctx.position
    if p.step_delay_ms:
        await asyncio.sleep(p.step_delay_ms / 1000)
    # A failing run stops at its first link until the fix is deployed (PYCHAIN_FIXED=1).
    if p.fail and i == 0 and os.environ.get("PYCHAIN_FIXED") != "1":
        raise Unknown(
            f"chain run {ctx.run_id} was started with `fail`: its first link stops for review"
        )
    messages = [system(PROMPT), user(f"Link {i} of {p.steps} in run {ctx.run_id}.")]
    answer = await ctx.model(messages, max_tokens=64, temperature=0.0)
    kill_at("after_model")
    # The checkpoint names the answer by its hash (the journal holds it word for word): the
    # SHA-256 of the answer as a JSON string, as the Rust chain's request_hash makes it.
    payload = hashlib.sha256(json.dumps(answer.content, ensure_ascii=False).encode()).hexdigest()
    output: dict[str, Any] = {"link": i, "answer_sha256": payload}
    if p.wait is not None and p.wait.at + 1 == i:
        event = await ctx.event()
        output["event"] = (
            None if event is None else {"id": event.get("id"), "payload": event.get("payload")}
        )
    if p.children is not None and p.children.at + 1 == i:
        output["children"] = await ctx.children_summary()
    await write_link(ctx, p.ledger, i, payload)
    outcome = next_of(p, i, output)
    kill_at("before_answer")
    return outcome


async def write_link(ctx: StepContext, how: str, i: int, payload: str) -> None:
    """The link's ledger row, as an outside write (effect) or with the step's commit (local)."""
    ref = reference(ctx.run_id, i)
    if how == "local":
        row = {"reference": ref, "run_id": ctx.run_id, "step": i, "payload": payload}
        await ctx.local_write(TABLE, row)
        return

    async def post(_key: str) -> dict[str, Any]:
        kill_at("after_begin")
        result = await ledger.post(ctx.run_id, i, ref, payload)
        kill_at("after_insert")
        return result

    await ctx.effect(link_key(ctx.run_id, i), {"reference": ref, "payload": payload}, post)


def next_of(p: Params, i: int, output: dict[str, Any]) -> Outcome:
    """Finish after the last link; else the next link, after the pause named for this one."""
    if i + 1 >= p.steps:
        return Outcome.finish(output)
    then = Outcome.goto(output, STEP)
    if p.sleep is not None and p.sleep.at == i:
        return then.sleep_for(p.sleep.secs)
    if p.wait is not None and p.wait.at == i:
        return then.wait_for_event(p.wait.event, p.wait.timeout_secs)
    if p.children is not None and p.children.at == i:
        return then.with_children(p.children.pause())
    return then


@wf.compensation(STEP, note="posts a reversal row undo:<reference> per link")
async def unlink(ctx: StepContext) -> Outcome:
    """A link's undo: a reversal row pointing at the original (nothing is deleted)."""
    if ctx.undo is None:
        raise Unknown("unlink runs only as a compensation")
    seq: int = ctx.undo["position"]
    p = Params.parse(ctx.input)
    reversed_ref = reference(ctx.run_id, seq)
    ref, payload = f"undo:{reversed_ref}", f"reversal of {reversed_ref}"
    if p.ledger == "local":
        row = {"reference": ref, "run_id": ctx.run_id, "step": seq, "payload": payload}
        await ctx.local_write(TABLE, row)
        result: Any = {"reference": ref, "with_commit": True}
    else:

        async def post(_key: str) -> dict[str, Any]:
            return await ledger.post(ctx.run_id, seq, ref, payload)

        key = f"undo:{link_key(ctx.run_id, seq)}"
        result = await ctx.effect(key, {"reference": ref, "payload": payload}, post)
    return Outcome.next({"reversed": seq, "ledger": result})


# --- serving ------------------------------------------------------------------------------


def make_app(prefix: str = "") -> App:
    """The endpoint (also `uvicorn --factory chain:make_app`); needs TRAILMARK_SECRET."""
    secret = os.environ.get("TRAILMARK_SECRET")
    if not secret:
        raise SystemExit(
            "pychain: set TRAILMARK_SECRET (at least 32 bytes, shared with the worker)"
        )
    try:
        return App([wf], secret=secret, prefix=prefix)
    except ValueError as e:
        raise SystemExit(f"pychain: {e}") from None


async def serve(app: App, host: str, port: int, prefix: str) -> None:
    """Runs uvicorn, saying where it listens once the port is open."""
    # Idle connections stay open longer than the worker's HTTP pool keeps them (90 s), so the
    # worker never reuses one this server is closing (that race reads as a failed attempt).
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level="info",
        access_log=False,
        timeout_keep_alive=120,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
        print(f"pychain listening on http://{host}:{bound}{prefix}", flush=True)
    try:
        await task
    finally:
        await ledger.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="pychain: the chain workflow as a trailmark-step/1 endpoint"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--prefix", default="", help="path the routes live under, e.g. /trailmark")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = make_app(args.prefix)
    asyncio.run(serve(app, args.host, args.port, args.prefix))


if __name__ == "__main__":
    main()
