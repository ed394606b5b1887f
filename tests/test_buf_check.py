"""scripts/buf_check.py and proto/buf.yaml: the wire contract passes `buf lint`, `buf breaking`
runs against a git base, and a renamed field in a copy of the proto fails it (shown on a copy,
as tests/test_gen_proto.py shows drift of the generated code)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import buf_check  # noqa: E402

try:
    BUF = buf_check.buf_binary()
except SystemExit as exc:  # make test installs it (npm ci --prefix tests/contract_node)
    pytest.skip(str(exc), allow_module_level=True)


def buf(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BUF, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300)


def copy_proto(into: Path) -> Path:
    shutil.copytree(ROOT / "proto", into)
    return into


def test_the_wire_contract_passes_buf_lint():
    result = buf("lint", "proto")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_renamed_field_fails_buf_breaking_and_an_added_one_does_not(tmp_path):
    base = copy_proto(tmp_path / "base")
    renamed = copy_proto(tmp_path / "renamed")
    router = renamed / "kvtier" / "v1" / "router.proto"
    text = router.read_text()
    assert "  string session_id = 4;" in text
    router.write_text(text.replace("  string session_id = 4;", "  string session = 4;"))

    result = buf("breaking", renamed, "--against", base)
    assert result.returncode != 0
    assert 'Field "4" on message "RouteRequest" changed name from "session_id" to "session"' in result.stdout, \
        result.stdout

    added = copy_proto(tmp_path / "added")
    router = added / "kvtier" / "v1" / "router.proto"
    router.write_text(router.read_text().replace(
        "  string session_id = 4;", "  string session_id = 4;\n  // A new field.\n  string hint = 99;"))
    result = buf("breaking", added, "--against", base)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_check_runs_lint_and_breaking_against_a_git_base():
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: buf_check.py skips the breaking check here too")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "buf_check.py"), "--against", "HEAD"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "$ buf lint proto" in result.stdout
    assert "buf breaking against" in result.stdout and "$ buf breaking proto --against" in result.stdout
