"""Workflow declarations: the steps, compensations and local tables an endpoint serves.

What is declared here is what the manifest tells the worker, so that the list of steps lives
with the code and nowhere else.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import StepContext
    from .outcome import Outcome

PROTOCOL = "trailmark-step/1"
#: The kinds a step can declare, as the worker knows them.
KINDS = frozenset({"read", "model", "write", "message", "human"})

Handler = Callable[["StepContext"], Awaitable["Outcome"]]

# The run-name rules: letters, digits, `-_.:`, at most 200 bytes (ASCII, so characters).
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


def _check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r} is not a valid name: use 1-200 letters, digits or -_.:")
    return name


@dataclass(frozen=True)
class LocalTable:
    """A table the workflow's steps write with the step's commit (`ctx.local_write`).

    The worker inserts the rows itself, in the step's transaction, once the operator lists the
    table in `remote.local_tables`.
    """

    name: str
    key: str
    columns: tuple[str, ...]

    def to_wire(self) -> dict[str, Any]:
        """The manifest's entry for this table."""
        return {"name": self.name, "key": self.key, "columns": list(self.columns)}


@dataclass
class StepDef:
    """One declared step: its handler and, when it can be undone, its compensation."""

    name: str
    kind: str
    key_recipe: str | None
    handler: Handler
    compensation: Handler | None = None
    compensation_note: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The manifest's entry for this step."""
        wire: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.key_recipe is not None:
            wire["key_recipe"] = self.key_recipe
        if self.compensation_note is not None:
            wire["compensation"] = self.compensation_note
        return wire


class Workflow:
    """A named, versioned workflow whose steps run in this endpoint.

    Steps run in declaration order unless a step's outcome names another (`Outcome.goto`);
    the first declared step is where a run starts.
    """

    def __init__(self, name: str, version: int = 1) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"workflow version must be an integer >= 1, got {version!r}")
        self.name = _check_name("workflow name", name)
        self.version = version
        self.steps: dict[str, StepDef] = {}
        self.local_tables: dict[str, LocalTable] = {}

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, version={self.version})"

    def local_table(self, name: str, key: str, columns: Sequence[str]) -> LocalTable:
        """Declares a table the steps write with `ctx.local_write`; `key` is its unique key."""
        _check_name("local table", name)
        if name in self.local_tables:
            raise ValueError(f"local table {name} is declared twice in {self!r}")
        cols = tuple(_check_name(f"a column of {name}", c) for c in columns)
        if key not in cols:
            raise ValueError(f"the key {key!r} of local table {name} must be one of its columns")
        table = LocalTable(name, key, cols)
        self.local_tables[name] = table
        return table

    def step(
        self, name: str, *, kind: str, key_recipe: str | None = None
    ) -> Callable[[Handler], Handler]:
        """Declares the step `name` run by the decorated `async def handler(ctx) -> Outcome`.

        `kind` is one of read, model, write, message, human; `key_recipe` documents how the
        step's idempotency keys are made (shown by the worker's tools).
        """
        _check_name("step name", name)
        if kind not in KINDS:
            raise ValueError(f"step kind {kind!r} is not one of {', '.join(sorted(KINDS))}")
        if name in self.steps:
            raise ValueError(f"step {name} is declared twice in {self!r}")

        def register(handler: Handler) -> Handler:
            self.steps[name] = StepDef(name, kind, key_recipe, handler)
            return handler

        return register

    def compensation(self, step: str, *, note: str) -> Callable[[Handler], Handler]:
        """Declares the decorated handler as the undo of the declared step `step`.

        `note` says what the undo does; the manifest carries it, and its presence tells the
        worker this endpoint serves the undo.
        """
        target = self.steps.get(step)
        if target is None:
            raise ValueError(f"compensation for {step}: declare the step itself first")
        if not note:
            raise ValueError(f"compensation for {step}: say in `note` what the undo does")
        if target.compensation is not None:
            raise ValueError(f"step {step} already has a compensation")

        def register(handler: Handler) -> Handler:
            target.compensation = handler
            target.compensation_note = note
            return handler

        return register

    def to_wire(self) -> dict[str, Any]:
        """The manifest's entry for this workflow."""
        return {
            "name": self.name,
            "version": self.version,
            "steps": [s.to_wire() for s in self.steps.values()],
            "local_tables": [t.to_wire() for t in self.local_tables.values()],
        }


def manifest(workflows: Sequence[Workflow]) -> dict[str, Any]:
    """The `GET /manifest` body for `workflows`."""
    return {"protocol": PROTOCOL, "workflows": [w.to_wire() for w in workflows]}
