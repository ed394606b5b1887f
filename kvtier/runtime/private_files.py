"""Files that hold secrets, and the directories that keep them.

Every file kvtier writes that holds a secret or a table of credentials (bearer tokens, token
tables, the embedded Valkey's password, ``kvtier up``'s stack record) goes through
``write_secret_file``: owner-only (0600) from the moment it exists, whoever writes it and
whatever umask they run under, and replaced atomically so a reader (a server re-reading its
token table) never sees half a file.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from kvtier.domain.errors import ConfigError

SECRET_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def write_secret_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600), never wider, even briefly.

    The text goes to a private temporary file beside ``path`` that then replaces it, so an
    existing file ends up 0600 too, whatever mode it had."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, SECRET_FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), SECRET_FILE_MODE)  # a stale temporary file keeps its old mode through O_CREAT
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_or_create_secret(path: Path, make: Callable[[], str]) -> str:
    """The secret kept in ``path``, or a fresh one from ``make()`` written there (0600).

    A kept file has its mode reasserted to 0600; surrounding whitespace is stripped."""
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        secret = ""
    if secret:
        os.chmod(path, SECRET_FILE_MODE)
        return secret
    secret = make()
    write_secret_file(path, secret + "\n")
    return secret


def ensure_private_dir(path: Path, *, field: str = "state_dir", flag: str = "--state-dir") -> Path:
    """Create ``path`` as 0700 when missing; refuse one that other users can open.

    A directory that holds credentials must be owned by this user and closed to everyone
    else: group or other permission bits of any kind (read lists it, execute reaches files
    whose names are known) fail with a ``ConfigError`` that names the path and the fix."""
    path = path.expanduser()
    if not path.exists():
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        os.chmod(path, PRIVATE_DIR_MODE)  # mkdir's mode is filtered through the umask
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{field} {path} is not a directory; pass a directory with {flag}", field=field)
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"{field} {path} belongs to uid {info.st_uid}, not to this user ({os.getuid()}); it would hold "
            f"this stack's credentials, so pass a directory you own with {flag}",
            field=field,
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"{field} {path} is open to other users (mode {mode:04o}) and would hold this stack's credentials "
            f"and directory-store password; run `chmod 700 {path}` or pass another directory with {flag}",
            field=field,
        )
    return path
