"""`kvtier up` and `kvtier down` as a user runs them: real processes, real endpoints (the
controller, Valkey and the OpenAI-compatible gateway on the bundled model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

HBM_GIB = 1 / 32  # half the stack's default of 64 MiB: the flag must reach the worker


def test_up_serves_and_down_stops_everything_it_started(tmp_path: Path):
    state = tmp_path / "state"
    env = {**os.environ, "RAY_ADDRESS": ""}  # a fresh local Ray, never a stale one
    log = (tmp_path / "up.log").open("w")  # a file, not a pipe nobody drains
    up = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "up", "--state-dir", str(state), "--port", "0",
         "--gateway-port", "0",
         "--hbm-gib", str(HBM_GIB), "--eviction-policy", "lru", "--session-hold-fraction", "1.0"],
        stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    try:
        record = state / "stack.json"
        deadline = time.monotonic() + 240
        # The gateway's URL lands in the record once the gateway serves, after the stack.
        while ("gateway" not in (record.read_text() if record.exists() else "") and time.monotonic() < deadline
               and up.poll() is None):
            time.sleep(0.2)
        assert record.exists(), (tmp_path / "up.log").read_text()[-3000:]
        endpoints = json.loads(record.read_text())
        assert endpoints["pid"] == up.pid and len(endpoints["workers"]) == 1
        with grpc.insecure_channel(endpoints["controller"]) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        # `kvtier up` turned auth on; status finds the admin token in the state directory.
        shown = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "status", "--controller", endpoints["controller"], "--json"],
            capture_output=True, text=True, timeout=60, env={**env, "KVTIER_STATE_DIR": str(state)},
        )
        assert shown.returncode == 0, shown.stderr
        view = json.loads(shown.stdout)
        assert view["is_leader"] and view["leader_address"] == endpoints["controller"]
        assert view["num_live_workers"] == 1 and view["is_directory_reachable"]
        tiers = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "tiers", "--controller", endpoints["controller"], "--json"],
            capture_output=True, text=True, timeout=60, env={**env, "KVTIER_STATE_DIR": str(state)},
        )
        assert tiers.returncode == 0, tiers.stderr
        (hbm,) = [row for row in json.loads(tiers.stdout)["tiers"] if row["tier"] == "hbm"]
        page_bytes = hbm["capacity_bytes"] // hbm["total_pages"]
        assert HBM_GIB * 2**30 - page_bytes < hbm["capacity_bytes"] <= HBM_GIB * 2**30

        # The frontend token `kvtier up` wrote (and printed) lists the served model for tenant "default".
        frontend_token = (state / "auth" / "frontend.token").read_text().strip()
        models = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "models", "--controller", endpoints["controller"],
             "--token", frontend_token, "--json"],
            capture_output=True, text=True, timeout=60, env=env,
        )
        assert models.returncode == 0, models.stderr
        (model,) = json.loads(models.stdout)["models"]
        assert model["namespace"]["tenant"] == "default" and model["num_workers"] == 1
        deadline = time.monotonic() + 30
        while "api key" not in (tmp_path / "up.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        printed = (tmp_path / "up.log").read_text()
        assert str(state / "auth" / "frontend.token") in printed
        # The gateway (OpenAI API) serves the bundled model; up printed its URL and the key.
        gateway = endpoints["gateway"]
        assert f"{gateway}/v1" in printed and frontend_token in printed
        import urllib.request

        request = urllib.request.Request(gateway + "/v1/models", headers={"Authorization": f"Bearer {frontend_token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert [m["id"] for m in json.loads(response.read())["data"]] == ["SmolLM2-135M-Instruct"]

        down = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "down", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=60,
        )
        assert down.returncode == 0, down.stderr
        assert up.wait(timeout=30) == 0
        assert not record.exists()
        valkey = state / "valkey"
        # The embedded Valkey it started is gone too: its port no longer answers.
        host, port = endpoints["redis"].removeprefix("redis://").split("/")[0].split(":")
        import socket

        with socket.socket() as sock:
            sock.settimeout(1)
            assert sock.connect_ex((host, int(port))) != 0, f"valkey still serving ({valkey})"
        gateway_host, gateway_port = gateway.removeprefix("http://").split(":")
        with socket.socket() as sock:
            sock.settimeout(1)
            assert sock.connect_ex((gateway_host, int(gateway_port))) != 0, "the gateway still serving"
        again = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "down", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=60,
        )
        assert again.returncode == 2 and "no running stack" in again.stderr and "Traceback" not in again.stderr
        gone = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "status", "--controller", endpoints["controller"]],
            capture_output=True, text=True, timeout=60,
        )
        assert gone.returncode == 2 and "Traceback" not in gone.stderr
        assert gone.stderr.count("\n") == 1 and endpoints["controller"] in gone.stderr
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        log.close()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--session-hold-fraction", "1.5"], "--session-hold-fraction"),
        (["--session-hold-fraction", "0"], "--session-hold-fraction"),
        (["--eviction-policy", "fifo"], "--eviction-policy"),
        (["--hbm-gib", "0"], "--hbm-gib"),
        (["--tool-parser", "mistral"], "--tool-parser"),
    ],
)
def test_up_refuses_a_bad_worker_setting_before_starting_anything(tmp_path: Path, flags: list[str], named: str):
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "up", "--state-dir", str(state), "--port", "0", *flags],
        capture_output=True, text=True, timeout=60, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1
    assert not state.exists()  # no Valkey, no Ray, no state written
