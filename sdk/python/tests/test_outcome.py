"""Outcomes as the step call's answer carries them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from trailmark import Children, Outcome


def test_each_next_kind() -> None:
    assert Outcome.next({"a": 1}).to_wire() == {"output": {"a": 1}, "next": "continue"}
    assert Outcome.finish([1]).to_wire() == {"output": [1], "next": "finish"}
    assert Outcome.wait({"q": "?"}).to_wire() == {"output": {"q": "?"}, "next": "wait"}
    assert Outcome.goto(None, "link").to_wire() == {"output": None, "next": {"goto": "link"}}


def test_pauses() -> None:
    slept = Outcome.goto({"link": 3}, "link").sleep_for(30)
    assert slept.to_wire() == {
        "output": {"link": 3},
        "next": {"goto": "link"},
        "pause": {"sleep_secs": 30},
    }
    when = datetime(2026, 12, 24, 10, 0, tzinfo=timezone(timedelta(hours=1)))
    assert Outcome.next(1).sleep_until(when).pause == {"sleep_until": "2026-12-24T09:00:00Z"}
    event = Outcome.next(1).wait_for_event(
        "supplier.reply", 60, key="PO-1", on_timeout_goto="chase"
    )
    assert event.pause == {
        "event": {
            "name": "supplier.reply",
            "timeout_secs": 60,
            "key": "PO-1",
            "on_timeout_goto": "chase",
        }
    }
    assert Outcome.next(1).wait_for_event("go", 1.5).pause == {
        "event": {"name": "go", "timeout_secs": 1.5}
    }
    children = Children(items=[("pychain", {"steps": 1}), ("other", {})], max_in_flight=1, first=1)
    assert Outcome.next(1).with_children(children).pause == {
        "children": {
            "items": [
                {"workflow": "pychain", "input": {"steps": 1}},
                {"workflow": "other", "input": {}},
            ],
            "max_in_flight": 1,
            "first": 1,
        }
    }
    share = Children(items=[("w", {})] * 4, fail_threshold=0.5).to_wire()
    assert share["children"]["fail_threshold"] == 0.5


def test_what_can_be_checked_locally_is() -> None:
    then = Outcome.next(1)
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="more than 0"):
            then.sleep_for(bad)
    with pytest.raises(ValueError, match="timezone-aware"):
        then.sleep_until(datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="event name"):
        then.wait_for_event("no spaces", 10)
    with pytest.raises(ValueError, match="more than 0"):
        then.wait_for_event("ok", 0)
    with pytest.raises(ValueError, match="cannot pause"):
        Outcome.finish(1).sleep_for(1)
    with pytest.raises(ValueError, match="cannot pause"):
        Outcome.wait(1).sleep_until(datetime.now(UTC))
    with pytest.raises(ValueError, match="first"):
        Children(items=[("w", {})], first=2)
    with pytest.raises(ValueError, match="max_in_flight"):
        Children(items=[("w", {})], max_in_flight=0)
    with pytest.raises(ValueError, match="share"):
        Children(items=[("w", {})], fail_threshold=1.5)
    with pytest.raises(ValueError, match="count"):
        Children(items=[("w", {})], fail_threshold=2)
    with pytest.raises(TypeError, match="pair"):
        Children(items=["w"])  # type: ignore[list-item]
