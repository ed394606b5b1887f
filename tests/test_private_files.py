"""Secret files are owner-only whoever writes them; a directory of credentials must be private,
and `kvtier up` refuses a state directory other users can open before starting anything."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.domain.errors import ConfigError
from kvtier.runtime.private_files import ensure_private_dir, read_or_create_secret, write_secret_file


@pytest.fixture
def open_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_secret_file_is_0600_new_or_replacing_a_readable_one(tmp_path, open_umask):
    path = tmp_path / "sub" / "secret"
    write_secret_file(path, "one\n")
    assert mode(path) == 0o600 and path.read_text() == "one\n"
    os.chmod(path, 0o644)
    write_secret_file(path, "two\n")
    assert mode(path) == 0o600 and path.read_text() == "two\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["secret"], "no temporary file left behind"


def test_a_kept_secret_is_reused_and_made_private_again(tmp_path, open_umask):
    path = tmp_path / "password"
    first = read_or_create_secret(path, lambda: "generated")
    assert first == "generated" and mode(path) == 0o600
    os.chmod(path, 0o644)
    assert read_or_create_secret(path, lambda: "another") == "generated" and mode(path) == 0o600


def test_a_missing_state_dir_is_created_0700_whatever_the_umask(tmp_path, open_umask):
    created = ensure_private_dir(tmp_path / "a" / "state")
    assert mode(created) == 0o700


@pytest.mark.parametrize("dir_mode", [0o755, 0o750, 0o711, 0o707])
def test_a_state_dir_others_can_open_is_refused_naming_the_path_and_the_fix(tmp_path, dir_mode):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, dir_mode)
    with pytest.raises(ConfigError) as info:
        ensure_private_dir(state)
    assert info.value.field == "state_dir"
    assert str(state) in info.value.message and f"chmod 700 {state}" in info.value.message
    assert f"{dir_mode:04o}" in info.value.message and "--state-dir" in info.value.message
    os.chmod(state, 0o700)
    assert ensure_private_dir(state) == state


def test_kvtier_up_refuses_an_open_state_dir_before_starting_anything(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "up", "--state-dir", str(state), "--port", "0"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert done.returncode == 2, done.stderr
    assert str(state) in done.stderr and "chmod 700" in done.stderr and "Traceback" not in done.stderr
    assert list(state.iterdir()) == [], "nothing was started or written"
