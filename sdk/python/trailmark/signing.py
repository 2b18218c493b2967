"""Request signatures of `trailmark-step/1`, both directions.

`trailmark-signature: v1=<hex HMAC-SHA256(secret, "<ts>\\n<METHOD>\\n<path>\\n" + body)>` with
`trailmark-timestamp: <ts>` (unix seconds). The path is in the signed text so that a signed
manifest read cannot be replayed as a step call; the timestamp bounds how long a captured
request can be replayed at all.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable

TIMESTAMP_HEADER = "trailmark-timestamp"
SIGNATURE_HEADER = "trailmark-signature"
#: How far a request's timestamp may be from the receiver's clock, in seconds.
MAX_SKEW_SECS = 300
#: The shortest secret accepted, in bytes (the protocol's minimum).
MIN_SECRET_BYTES = 32


def secret_bytes(secret: str | bytes) -> bytes:
    """The secret as the key bytes: a `str` is used as its UTF-8 bytes, as written."""
    return secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)


def check_secret(secret: str | bytes) -> bytes:
    """The secret's bytes, or ValueError when it is too short to be one."""
    key = secret_bytes(secret)
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the trailmark secret is {len(key)} bytes; it must be at least {MIN_SECRET_BYTES}: "
            "generate one (e.g. `openssl rand -hex 32`) and give the same value to this endpoint "
            "and to the worker (TRAILMARK_REMOTE_SECRET_<NAME>)"
        )
    return key


def _digest(key: bytes, timestamp: int, method: str, path: str, body: bytes) -> bytes:
    text = f"{timestamp}\n{method.upper()}\n{path}\n".encode() + body
    return hmac.new(key, text, hashlib.sha256).digest()


def signature(key: bytes, timestamp: int, method: str, path: str, body: bytes) -> str:
    """The `v1=<hex>` signature of one request."""
    return "v1=" + _digest(key, timestamp, method, path, body).hex()


def sign(
    key: bytes, method: str, path: str, body: bytes, now: float | None = None
) -> dict[str, str]:
    """The two signature headers for a request about to be sent."""
    timestamp = int(time.time() if now is None else now)
    return {
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: signature(key, timestamp, method, path, body),
    }


def refusal(
    key: bytes,
    timestamp: str | None,
    sig: str | None,
    method: str,
    paths: Iterable[str],
    body: bytes,
    now: float | None = None,
) -> str | None:
    """Why a received request's signature is refused, or None when it holds.

    `paths` are the spellings of the request's path the receiver accepts as "sent" (see
    `App`); each leads to the same route, so accepting any of them keeps the route signed.
    """
    if not timestamp or not sig:
        return f"the request carries no {TIMESTAMP_HEADER} or no {SIGNATURE_HEADER} header"
    try:
        ts = int(timestamp.strip())
    except ValueError:
        return f"{TIMESTAMP_HEADER} is not unix seconds"
    skew = abs((time.time() if now is None else now) - ts)
    if skew > MAX_SKEW_SECS:
        return (
            f"the timestamp is {skew:.0f} s from this endpoint's clock (at most {MAX_SKEW_SECS} "
            "allowed): a replayed request, or clocks that need syncing"
        )
    given = _tag(sig)
    for path in paths:
        if given is not None and hmac.compare_digest(_digest(key, ts, method, path, body), given):
            return None
    return (
        "the signature does not match the request: the worker and this endpoint hold different "
        "secrets, or the request was changed on the way"
    )


def _tag(sig: str) -> bytes | None:
    """The HMAC bytes of a `v1=<hex>` header (either case of hex), or None if it is not one."""
    sig = sig.strip()
    if not sig.startswith("v1="):
        return None
    try:
        return bytes.fromhex(sig[3:])
    except ValueError:
        return None
