#!/usr/bin/env python3
"""`buf lint` and `buf breaking` over proto/ (the wire contract), for `make test`.

    python scripts/buf_check.py                 # lint, then breaking against the base below
    python scripts/buf_check.py --against REF   # breaking against a git ref of your choice

The base of the breaking check, first that exists:
1. ``$KVTIER_BUF_AGAINST`` (a git ref);
2. the newest release tag (``v*``) that is an ancestor of HEAD;
3. the merge base of HEAD with ``origin/main`` or ``main``; when that is HEAD itself (a
   commit on main), HEAD's first parent, so each commit is checked against the one before.
Without git history (an archive, a shallow clone with no parent) the breaking check is
skipped with the reason printed; lint always runs.

The base's ``proto/`` is read with ``git archive`` (works in a worktree and a plain clone)
and checked with this checkout's ``proto/buf.yaml``, so a rule change applies to both sides.
``buf`` is the npm package ``@bufbuild/buf`` pinned in tests/contract_node/package.json
(``make test`` installs it); ``$BUF`` names another binary.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = "proto"
LOCAL_BUF = ROOT / "tests" / "contract_node" / "node_modules" / ".bin" / "buf"


def buf_binary() -> str:
    found = os.environ.get("BUF") or (str(LOCAL_BUF) if LOCAL_BUF.exists() else shutil.which("buf"))
    if not found:
        raise SystemExit(
            "buf not found: run `npm ci --prefix tests/contract_node` (make test does), or set BUF=/path/to/buf"
        )
    return found


def _git(*args: str) -> str | None:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else None


def base_ref() -> tuple[str | None, str]:
    """(the commit to compare against, how it was chosen) or (None, why there is none)."""
    if env := os.environ.get("KVTIER_BUF_AGAINST"):
        commit = _git("rev-parse", "--verify", f"{env}^{{commit}}")
        return (commit, f"$KVTIER_BUF_AGAINST={env}") if commit else (None, f"$KVTIER_BUF_AGAINST={env} is no commit")
    if _git("rev-parse", "--verify", "HEAD") is None:
        return None, "no git history here"
    if tag := _git("describe", "--tags", "--abbrev=0", "--match", "v*", "HEAD"):
        return _git("rev-parse", f"{tag}^{{commit}}"), f"the last release tag {tag}"
    head = _git("rev-parse", "HEAD")
    for main in ("origin/main", "main"):
        base = _git("merge-base", "HEAD", main)
        if base is None:
            continue
        if base != head:
            return base, f"the merge base with {main}"
        parent = _git("rev-parse", "--verify", "HEAD^1")
        if parent:
            return parent, f"HEAD's parent (HEAD is on {main})"
        return None, f"HEAD is on {main} and has no parent in this clone (shallow?)"
    return None, "no release tag and no main branch to take a merge base with"


def extract_proto(commit: str, into: Path) -> Path | None:
    """``commit``'s proto/ under ``into`` (None when it has none), with this checkout's buf.yaml."""
    archive = subprocess.run(["git", "archive", "--format=tar", commit, PROTO], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        return None
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    shutil.copy(ROOT / PROTO / "buf.yaml", into / PROTO / "buf.yaml")
    return into / PROTO


def run_buf(buf: str, *args: str) -> int:
    print("$ buf " + " ".join(args), flush=True)
    return subprocess.run([buf, *args], cwd=ROOT).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="git ref to check breaking changes against (default: see above)")
    args = parser.parse_args()
    buf = buf_binary()
    if run_buf(buf, "lint", PROTO) != 0:
        print("buf lint failed: fix the proto, or add a reasoned exception to proto/buf.yaml", file=sys.stderr)
        return 1
    if args.against:
        commit, how = _git("rev-parse", "--verify", f"{args.against}^{{commit}}"), f"--against {args.against}"
        if commit is None:
            print(f"buf breaking: {args.against} is not a commit here", file=sys.stderr)
            return 2
    else:
        commit, how = base_ref()
    if commit is None:
        print(f"buf breaking skipped: {how}")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvtier-buf-") as tmp:
        against = extract_proto(commit, Path(tmp))
        if against is None:
            print(f"buf breaking skipped: {commit[:12]} ({how}) has no {PROTO}/")
            return 0
        print(f"buf breaking against {commit[:12]} ({how})")
        if run_buf(buf, "breaking", PROTO, "--against", str(against)) != 0:
            print("buf breaking failed: the change breaks clients of the wire contract; add new fields "
                  "instead of renaming, renumbering or retyping, or deprecate and reserve", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
