"""Run mypy over kvtier as it installs: ``kvtier.worker`` and ``kvtier.controller`` included.

``worker/`` and ``controller/`` install as ``kvtier.worker`` and ``kvtier.controller`` through
setuptools' ``package-dir`` mapping, which mypy cannot follow. So this builds a tree of
symbolic links in ``build/typecheck/`` with the installed layout (``kvtier/`` holding the
package's entries plus ``worker`` and ``controller``; ``loadtests`` beside it) and runs mypy
there with the repository's ``[tool.mypy]`` configuration. Every import is then checked
with its real types. Reported paths are the tree's: ``kvtier/worker/x.py`` is ``worker/x.py``.

    python scripts/typecheck.py [mypy arguments]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
# (link inside the tree, the repository path it points at)
MAPPED = {"kvtier/worker": "worker", "kvtier/controller": "controller", "loadtests": "loadtests"}


def build_tree() -> None:
    shutil.rmtree(TREE, ignore_errors=True)
    (TREE / "kvtier").mkdir(parents=True)
    for entry in sorted((ROOT / "kvtier").iterdir()):
        if entry.name != "__pycache__":
            os.symlink(entry, TREE / "kvtier" / entry.name)
    for link, target in MAPPED.items():
        os.symlink(ROOT / target, TREE / link)


def main(argv: list[str]) -> int:
    build_tree()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(ROOT / ".mypy_cache"), *(argv or ["kvtier"])]
    return subprocess.call(cmd, cwd=TREE)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
