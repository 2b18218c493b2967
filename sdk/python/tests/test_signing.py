"""Signatures: made and checked as the protocol says, in both directions."""

from __future__ import annotations

import hashlib
import hmac
import time

import pytest
from support import KEY, FakeWorker, endpoint, get_signed, make_app, post_signed, step_call

from trailmark import App, Workflow, signing


def test_the_signature_is_hmac_sha256_of_timestamp_method_path_and_body() -> None:
    body = b'{"a":1}'
    text = b"1700000000\nPOST\n/trailmark/step\n" + body
    expected = "v1=" + hmac.new(KEY, text, hashlib.sha256).hexdigest()
    assert signing.signature(KEY, 1700000000, "post", "/trailmark/step", body) == expected


def test_the_signature_matches_the_worker_s_vector() -> None:
    # The same vector as the Rust worker's src/remote/signing.rs test.
    key = b"0123456789abcdef0123456789abcdef"
    assert (
        signing.signature(key, 1700000000, "GET", "/trailmark/manifest", b"")
        == "v1=a5002d7f5d8577b9f3af32b148ff10ed0d3e7d82882b7e84cfce3b0d2c729050"
    )


def test_a_signed_request_holds_and_a_changed_one_does_not() -> None:
    now = time.time()
    headers = signing.sign(KEY, "POST", "/step", b"{}", now=now)
    ts, sig = headers["trailmark-timestamp"], headers["trailmark-signature"]

    def check(**kw: object) -> str | None:
        args: dict[str, object] = {"method": "POST", "paths": ["/step"], "body": b"{}", "now": now}
        args.update(kw)
        return signing.refusal(KEY, ts, sig, **args)  # type: ignore[arg-type]

    assert check() is None
    assert (
        signing.refusal(KEY, ts, sig.upper().replace("V1=", "v1="), "POST", ["/step"], b"{}")
        is None
    )
    assert "does not match" in (signing.refusal(KEY, ts, "v2=00", "POST", ["/step"], b"{}") or "")
    assert "does not match" in (check(body=b'{"x":1}') or "")
    assert "does not match" in (check(paths=["/manifest"]) or "")
    assert "does not match" in (check(method="GET") or "")
    assert "clock" in (check(now=now + 301) or "")
    assert check(now=now + 299) is None
    assert "does not match" in (signing.refusal(b"x" * 32, ts, sig, "POST", ["/step"], b"{}") or "")
    assert "no trailmark-timestamp" in (
        signing.refusal(KEY, None, sig, "POST", ["/step"], b"") or ""
    )


def test_a_short_secret_is_refused_saying_what_to_do() -> None:
    with pytest.raises(ValueError, match="at least 32"):
        App([], secret="too-short")


async def test_the_endpoint_refuses_unsigned_old_tampered_and_replayed_requests() -> None:
    wf = Workflow("wf")
    app = make_app([wf], FakeWorker())
    async with endpoint(app) as client:
        unsigned = await client.get("/manifest")
        assert unsigned.status_code == 401
        assert unsigned.json()["error"]["code"] == "bad_signature"
        assert (await get_signed(client, "/manifest")).status_code == 200

        old = signing.sign(KEY, "GET", "/manifest", b"", now=time.time() - 301)
        assert (await client.get("/manifest", headers=old)).status_code == 401

        body = b'{"protocol":"trailmark-step/1"}'
        headers = signing.sign(KEY, "POST", "/step", body)
        tampered = await client.post("/step", content=body + b" ", headers=headers)
        assert tampered.status_code == 401

        # A signed manifest read replayed as a step call: the path is in the signed text.
        replayed = await post_signed(client, "/step", step_call("t"), sign_path="/manifest")
        assert replayed.status_code == 401
        assert "secret" not in replayed.text.replace("secrets", "")
