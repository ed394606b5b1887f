"""Build-on-first-use C++ extensions: compiled once, cached, and optional.

kvtier's C++ kernels (paged attention on CPU, fused page copy + checksum) are plain
``TORCH_LIBRARY`` sources compiled with ``torch.utils.cpp_extension`` (a C++ compiler and
``ninja``) the first time a process needs them, and cached under
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); later processes load
the cached library in well under a second. They are built with ``-march=native``, so
the extension name carries a digest of the CPU's feature flags (and torch's version):
hosts that share a cache directory but differ in ISA never load each other's binary.

Every kernel has a pure-torch equivalent. ``NativeExtension.load()`` raises
``FailedPrecondition`` naming the cause when the build is impossible, once per process
(the failure is remembered, the compiler is not retried on every call); callers catch
it, log one warning and use the torch path, so a worker without a compiler is slow,
not down.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

from kvtier.domain.errors import FailedPrecondition

logger = logging.getLogger("kvtier.tiers.native")

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-DNDEBUG", "-Wno-psabi")


def cpu_tag() -> str:
    """Digest of what ``-march=native`` depends on: architecture and CPU feature flags."""
    import torch

    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    text = f"{platform.machine()}|{flags}|{torch.__version__}"
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


def build_directory(name: str) -> Path:
    """Where ``name`` is built: one directory per Python environment (a second checkout's venv
    no longer rebuilds into, and waits on, the first one's), under ``KVTIER_EXTENSIONS_DIR``
    (default ``~/.cache/kvtier/extensions``)."""
    root = Path(os.environ.get("KVTIER_EXTENSIONS_DIR") or Path.home() / ".cache" / "kvtier" / "extensions")
    env = hashlib.blake2b(sys.prefix.encode(), digest_size=4).hexdigest()
    return root / f"{name}-{env}"


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip ``ninja`` wheel may sit in an unactivated venv."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # cpp_extension reports "Ninja is required" and the caller falls back
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build_failure_summary(exc: Exception) -> str:
    """The line of a build log that names the cause (cpp_extension puts it mid-message)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        lowered = line.lower()
        if "error:" in lowered or "not found" in lowered or "is required" in lowered:
            return line[:300]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else 'no message'}"


class NativeExtension:
    """One C++ source registering ``torch.ops.<namespace>.*``, built or loaded once per process.

    ``what`` names the kernel in messages; ``fallback_hint`` tells the operator how to run
    without it. ``load()`` is thread-safe: concurrent first callers wait for one build, and
    across processes torch's build lock serialises builds of the same extension directory.
    """

    def __init__(
        self,
        name: str,
        source: Path,
        *,
        what: str,
        fallback_hint: str,
        extra_cflags: tuple[str, ...] = (),
        extra_ldflags: tuple[str, ...] = ("-fopenmp",),
    ) -> None:
        self.name = name
        self.source = source
        self.what = what
        self.fallback_hint = fallback_hint
        self.cflags = [*CFLAGS, *extra_cflags]
        self.ldflags = list(extra_ldflags)
        self._lock = threading.Lock()
        self._loaded = False
        self._error: FailedPrecondition | None = None

    @property
    def is_loaded(self) -> bool:
        return self._loaded

    def load(self) -> None:
        """Build or load the extension; raise ``FailedPrecondition`` (remembered) if impossible."""
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            if self._error is not None:
                raise self._error
            start_s = time.monotonic()
            try:
                from torch.utils import cpp_extension

                _ensure_ninja_on_path()
                name = f"{self.name}_{cpu_tag()}"
                directory = build_directory(name)
                directory.mkdir(parents=True, exist_ok=True)
                # torch serialises builds with a lock *file* that a builder killed mid-build
                # (a worker process a test or an operator kills) leaves behind, and every later
                # load then waits on it forever. Builders here first take an flock, which the OS
                # releases when its holder dies; whoever holds it knows any lock file is stale.
                with open(directory / ".kvtier-build.lock", "w") as guard:
                    fcntl.flock(guard, fcntl.LOCK_EX)
                    (directory / "lock").unlink(missing_ok=True)
                    cpp_extension.load(
                        name=name,
                        sources=[str(self.source)],
                        extra_cflags=self.cflags,
                        extra_ldflags=self.ldflags,
                        build_directory=str(directory),
                        is_python_module=False,
                        verbose=False,
                    )
            except Exception as exc:  # compiler missing, ninja missing, headers missing, ...
                logger.debug("%s build output:\n%s", self.what, exc)
                self._error = FailedPrecondition(
                    f"the C++ {self.what} could not be built or loaded ({build_failure_summary(exc)}); "
                    f"install a C++ compiler and `pip install ninja`, or {self.fallback_hint}"
                )
                raise self._error from exc
            self._loaded = True
            logger.info("%s ready in %.1f s", self.what, time.monotonic() - start_s)
