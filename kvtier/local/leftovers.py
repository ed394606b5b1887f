"""Processes a ``kvtier up`` left running after it died without stopping them (SIGKILL, OOM).

Valkey and Ray's GCS and raylet die with the process that started them (parent-death
signals), but Ray's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) outlive it.
``kvtier down`` finds what is left from the stack's record alone, never by name, since other
Ray instances may run on the same machine:

- every process holding a file open under the Ray session directory the stack started (its
  logs live there, so each process of that Ray instance does, and no other instance's does);
- the recorded Valkey pid, if that process still is a Valkey server on the recorded port.

Only processes of this user are visible (``/proc/<pid>/fd`` of others is unreadable), which is
also the limit of what ``kvtier down`` may stop. Linux only (procfs); elsewhere nothing is found.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class Leftover:
    pid: int
    name: str  # its command line as ps shows it, shortened


def find_leftovers(record: dict[str, Any]) -> list[Leftover]:
    """The stack's processes still running, from its record (``stack.json``)."""
    found: dict[int, Leftover] = {}
    session = record.get("ray_session_dir")
    if session:
        prefix = str(Path(session)) + "/"
        for pid in _pids():
            if any(target.startswith(prefix) for target in _open_files(pid)):
                found[pid] = Leftover(pid, _name(pid))
    valkey_pid, redis = record.get("valkey_pid"), str(record.get("redis") or "")
    if isinstance(valkey_pid, int) and valkey_pid not in found:
        name = _name(valkey_pid)
        port = redis.rsplit(":", 1)[-1].split("/")[0]
        if ("valkey" in name or "redis" in name) and port and f":{port}" in name:
            found[valkey_pid] = Leftover(valkey_pid, name)
    found.pop(os.getpid(), None)
    return sorted(found.values(), key=lambda leftover: leftover.pid)


def stop_leftovers(leftovers: list[Leftover], *, timeout_s: float = 10.0) -> list[Leftover]:
    """SIGTERM each, SIGKILL what is still there after ``timeout_s``; returns those that remain."""
    for leftover in leftovers:
        _signal(leftover.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    remaining = leftovers
    while remaining and time.monotonic() < deadline:
        time.sleep(0.1)
        remaining = [leftover for leftover in remaining if is_running(leftover.pid)]
    for leftover in remaining:
        _signal(leftover.pid, signal.SIGKILL)
    time.sleep(0.2 if remaining else 0)
    return [leftover for leftover in remaining if is_running(leftover.pid)]


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an exited child its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return True  # no procfs: trust the signal probe
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pids() -> list[int]:
    try:
        return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]
    except OSError:
        return []


def _open_files(pid: int) -> list[str]:
    try:
        fds = list((PROC / str(pid) / "fd").iterdir())
    except OSError:  # gone, or not ours
        return []
    targets = []
    for fd in fds:
        try:
            targets.append(os.readlink(fd))
        except OSError:
            continue
    return targets


def _name(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120]


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
