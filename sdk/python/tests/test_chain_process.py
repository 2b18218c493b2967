"""examples/chain.py as a real process: what the engine's tests start (no Postgres needed here)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from support import KEY, SECRET, FakeWorker, attempt_path, step_call

from trailmark import signing

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "chain.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Pychain:
    """One `chain.py` process on a free port, under `/trailmark`."""

    def __init__(self, tmp: Path, **env: str) -> None:
        self.port = free_port()
        self.log = tmp / f"pychain-{self.port}.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PYCHAIN_")}
        environ.pop("DATABASE_URL", None)
        environ.update({"TRAILMARK_SECRET": SECRET, **env})
        args = ["--host", "127.0.0.1", "--port", str(self.port), "--prefix", "/trailmark"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(EXAMPLE), *args],
                env=environ,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        self.url = f"http://127.0.0.1:{self.port}/trailmark"
        self.first_line = self._first_line(timeout=20)

    def _first_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline().decode() if ready else ""
        if not line:
            self.stop()
            pytest.fail(f"pychain did not start: {self.log.read_text()}")
        return line.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def signed(method: str, path: str, body: bytes = b"") -> dict[str, str]:
    return signing.sign(KEY, method, path, body)


class WorkerServer:
    """The fake worker's callbacks over real HTTP (uvicorn in a thread)."""

    def __init__(self, worker: FakeWorker) -> None:
        config = uvicorn.Config(
            worker, host="127.0.0.1", port=0, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake worker did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def worker() -> Iterator[tuple[FakeWorker, WorkerServer]]:
    fake = FakeWorker(delay=0)
    server = WorkerServer(fake)
    yield fake, server
    server.stop()


def call_link(
    pychain: Pychain, fake: FakeWorker, server: WorkerServer, **input: Any
) -> httpx.Response:
    token = fake.open()
    body = step_call(token, workflow="pychain", step="link", position=0, input=input)
    body["callback"]["url"] = server.base_url + attempt_path(token)
    raw = json.dumps(body).encode()
    return httpx.post(
        pychain.url + "/step",
        content=raw,
        headers=signed("POST", "/trailmark/step", raw),
        timeout=20,
    )


def test_it_serves_a_signed_manifest_and_refuses_an_unsigned_one(tmp_path: Path) -> None:
    pychain = Pychain(tmp_path)
    try:
        assert pychain.first_line == f"pychain listening on {pychain.url}"
        manifest = httpx.get(
            pychain.url + "/manifest", headers=signed("GET", "/trailmark/manifest")
        )
        assert manifest.status_code == 200
        wf = manifest.json()["workflows"][0]
        assert (wf["name"], wf["version"], wf["steps"][0]["name"]) == ("pychain", 1, "link")
        assert wf["local_tables"][0]["name"] == "trailmark.chain_ledger"

        unsigned = httpx.get(pychain.url + "/manifest")
        assert unsigned.status_code == 401
        assert unsigned.json()["error"]["code"] == "bad_signature"
        assert httpx.get(f"http://127.0.0.1:{pychain.port}/manifest").status_code == 401
    finally:
        pychain.stop()


def test_a_link_runs_with_callbacks_over_http(
    tmp_path: Path, worker: tuple[FakeWorker, WorkerServer]
) -> None:
    fake, server = worker
    pychain = Pychain(tmp_path, PYCHAIN_NAME="pychain")
    try:
        answer = call_link(pychain, fake, server, steps=2, ledger="local")
        assert answer.status_code == 200, answer.text
        assert answer.json()["next"] == {"goto": "link"}
        assert fake.ops() == ["model", "local-write"]
    finally:
        pychain.stop()


def test_a_kill_spot_kills_once(tmp_path: Path, worker: tuple[FakeWorker, WorkerServer]) -> None:
    fake, server = worker
    once = tmp_path / "killed-once"
    env = {"PYCHAIN_KILL_AT": "after_model", "PYCHAIN_KILL_ONCE": str(once)}
    pychain = Pychain(tmp_path, **env)
    try:
        with pytest.raises(httpx.HTTPError):
            call_link(pychain, fake, server, steps=2, ledger="local")
        assert pychain.proc.wait(timeout=10) == -signal.SIGKILL
        assert once.exists() and fake.ops() == ["model"]
    finally:
        pychain.stop()
    restarted = Pychain(tmp_path, **env)  # the file exists: this one goes on
    try:
        assert call_link(restarted, fake, server, steps=2, ledger="local").status_code == 200
    finally:
        restarted.stop()


def test_it_refuses_to_start_without_a_secret() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "TRAILMARK_SECRET"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--port", str(free_port())],
        env=environ,
        capture_output=True,
        timeout=30,
    )
    assert done.returncode != 0 and b"TRAILMARK_SECRET" in done.stderr
