"""A `kvtier up` stack attacked and broken from outside, as a local user would: its directory
store refuses callers without the password, a worker whose Ray process is SIGKILLed comes back
and serves the same tokens, and `kvtier down` after a SIGKILLed `kvtier up` leaves nothing of
the stack running (Ray's agents included).

One `kvtier up` for the module (real Ray, Valkey, controller and worker processes); the tests
run in file order and the last one kills it. Processes are found from the stack's record (its
Ray session directory, its Valkey pid), never by name alone: other Ray instances may share the box.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from kvtier.client import Client
from kvtier.engine import SamplingParams
from kvtier.local.leftovers import find_leftovers, is_running

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
RESTART_S = 30.0


def wait_for(check, *, timeout_s: float, what: str):
    """Poll ``check`` until it returns something truthy (a ceiling, never a speed assertion)."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.2)
    return result


class UpProcess:
    def __init__(self, root: Path) -> None:
        self.state = root / "state"
        self.log_path = root / "up.log"
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli.main", "up", "--state-dir", str(self.state), "--port", "0"],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": ""},
            start_new_session=True,
        )

    @property
    def record_path(self) -> Path:
        return self.state / "stack.json"

    def record(self) -> dict:
        return json.loads(self.record_path.read_text())

    def log(self) -> str:
        return self.log_path.read_text()

    def token(self, name: str) -> str:
        return (self.state / "auth" / f"{name}.token").read_text().strip()

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        record = self.record_path
        if record.exists():  # a failed test must not leave the stack's processes behind
            for leftover in find_leftovers(json.loads(record.read_text())):
                os.kill(leftover.pid, signal.SIGKILL)
        self._log.close()


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    stack = UpProcess(tmp_path_factory.mktemp("up"))
    try:
        deadline = time.monotonic() + 240
        while not stack.record_path.exists() and time.monotonic() < deadline and stack.process.poll() is None:
            time.sleep(0.2)
        assert stack.record_path.exists(), stack.log()[-3000:]
        yield stack
    finally:
        stack.close()


def test_the_record_holds_no_secret_and_valkey_refuses_callers_without_the_password(up):
    record_text = up.record_path.read_text()
    record = json.loads(record_text)
    assert stat.S_IMODE(up.record_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(up.state.stat().st_mode) == 0o700
    password_file = Path(record["redis_password_file"])
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    password = password_file.read_text().strip()
    secrets = [password, *(up.token(name) for name in ("admin", "worker-0", "frontend"))]
    assert not [s for s in secrets if s in record_text or s in up.log()]
    assert "@" not in record["redis"]

    stranger = redis.Redis.from_url(record["redis"], socket_timeout=5)
    for attempt in (lambda: stranger.keys("*"), lambda: stranger.set("kvtier:planted", "x")):
        with pytest.raises(redis.AuthenticationError):
            attempt()
    stranger.close()
    owner = redis.Redis.from_url(record["redis"], password=password, socket_timeout=5)
    assert owner.ping() and owner.get("kvtier:planted") is None
    owner.close()


def _worker_actor_pid(session_dir: str) -> int:
    (actor,) = [p for p in find_leftovers({"ray_session_dir": session_dir}) if p.name.startswith("ray::WorkerActor")]
    return actor.pid


def test_a_worker_whose_ray_process_is_sigkilled_comes_back_and_serves_the_same_tokens(up):
    record = up.record()
    controller = record["controller"]
    with Client(controller, token=up.token("admin"), timeout_s=60) as admin, \
            Client(controller, token=up.token("frontend"), timeout_s=60) as frontend:
        (before,) = admin.list_workers()
        (model,) = frontend.list_models()
        sampling = SamplingParams(max_tokens=12, ignore_eos=True)
        tokens, _ = frontend.complete(model.namespace, PROMPT, sampling)

        pid = _worker_actor_pid(record["ray_session_dir"])
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()

        def back():
            workers = admin.list_workers()
            return [w for w in workers if w.worker_id == before.worker_id and w.boot_id != before.boot_id]

        (after,) = wait_for(back, timeout_s=RESTART_S, what="the restarted worker in ListWorkers")
        took_s = time.monotonic() - killed_at
        assert after.address != before.address and not is_running(pid)
        tokens_again, _ = frontend.complete(model.namespace, PROMPT, sampling)
        assert tokens_again == tokens, "same checkpoint, greedy: the same tokens"
    # `kvtier up` followed it: the record names the new address, and the log says so.
    wait_for(lambda: up.record()["workers"][before.worker_id] == after.address, timeout_s=30,
             what="stack.json to follow the restarted worker")
    assert f"{before.worker_id} was restarted by Ray" in up.log()
    assert stat.S_IMODE(up.record_path.stat().st_mode) == 0o600 and up.record()["problems"] == {}
    print(f"worker back in ListWorkers {took_s:.1f} s after SIGKILL")


def test_down_after_a_sigkilled_up_stops_everything_it_left_running(up):
    record = up.record()
    left = lambda: find_leftovers(record)  # noqa: E731
    assert any("DashboardAgent" in p.name for p in left()), [p.name for p in left()]
    os.kill(up.process.pid, signal.SIGKILL)
    up.process.wait(timeout=30)
    time.sleep(2)  # what dies with it has died; Ray's agents stay
    survivors = [p.name for p in left()]
    assert survivors, "nothing outlived the SIGKILLed `kvtier up`: this test would prove nothing"

    down = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "down", "--state-dir", str(up.state)],
        capture_output=True, text=True, timeout=120,
    )
    assert down.returncode == 0, down.stderr
    assert "had died" in down.stdout and "process(es) it left running" in down.stdout, down.stdout
    assert left() == [], f"still running after `kvtier down`: {left()} (it had {survivors})"
    assert not up.record_path.exists()
    valkey_pid = record["valkey_pid"]
    assert not is_running(valkey_pid)
