"""Who may call what: bearer tokens, their roles, and the tenants a frontend may act for (DESIGN §8).

A token table is a YAML or TOML file; each entry names a caller, its role and, for a
frontend, the tenants it may act for. Tokens are stored only as the SHA-256 of the token
text, so the file can be read by an operator or mounted from a Secret without handing
out credentials::

    tokens:                                   # YAML; TOML uses [[tokens]] tables
      - name: frontend-acme
        role: frontend                        # frontend | worker | admin
        tenants: [acme]                       # frontend only, at least one
        sha256: 5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8
      - name: worker-0
        role: worker
        worker_id: worker-0                   # worker only, required: the one id it may register
        sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08

``kvtier token create --role frontend --tenant acme --name frontend-acme --table FILE``
prints a fresh token once and appends its hashed entry; ``kvtier token hash`` hashes a
token read from stdin. Tokens are 256 random bits, so one unsalted SHA-256 is enough: there
is nothing to guess a preimage from (a slow password hash protects low-entropy secrets).

Tenant binding (``Principal.tenant_for``): an admin acts for any tenant, a request naming
none stays in the default (empty) tenant; a frontend acts only for its own tenants, and a
request naming no tenant gets the token's tenant when it has exactly one. A worker token is
bound to one worker id: the controller accepts a WorkerLink registration only for that id.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import re
import secrets
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvtier.domain.errors import ConfigError, InvalidArgument, PermissionDenied
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.runtime.log import get_logger
from kvtier.runtime.private_files import write_secret_file

log = get_logger("kvtier.rpc.auth")

TOKEN_PREFIX = "kvt_"
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}$")
_ENTRY_KEYS = frozenset({"name", "role", "tenants", "worker_id", "sha256"})
_WORKER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}$")


class Role(enum.StrEnum):
    FRONTEND = "frontend"  # Route, Sessions, Worker.Generate, for its own tenants
    WORKER = "worker"  # WorkerLink.Connect
    ADMIN = "admin"  # everything but WorkerLink, for any tenant


ROLES = tuple(r.value for r in Role)


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: the token entry's name, role, tenants (frontends only) and worker
    id (workers only). ``key_digest`` is the SHA-256 of its token (what the table stores): the
    key a worker's address proof is checked with (``kvtier.rpc.identity``)."""

    name: str
    role: Role
    tenants: frozenset[str] = frozenset()
    worker_id: str | None = None
    key_digest: bytes = dataclasses.field(default=b"", repr=False, compare=False)

    def may_act_for(self, tenant: str) -> bool:
        """Whether this caller may act on ``tenant``'s resources (an admin: any tenant)."""
        return self.role is Role.ADMIN or (self.role is Role.FRONTEND and tenant in self.tenants)

    def tenant_for(self, requested: str) -> str:
        """The tenant a request naming ``requested`` ("" for none) acts for, or raise.

        ``PermissionDenied`` (field ``namespace.tenant``) when the request names a tenant
        this caller may not act for; ``InvalidArgument`` when it names none and the token
        is bound to several.
        """
        if self.role is Role.ADMIN:
            return requested
        if self.role is not Role.FRONTEND:
            raise PermissionDenied(
                f"role {self.role} may not act for a tenant; use a frontend or admin token",
                field="namespace.tenant",
            )
        if not requested:
            if len(self.tenants) == 1:
                return next(iter(self.tenants))
            raise InvalidArgument(
                f"namespace.tenant is required: token {self.name!r} acts for {len(self.tenants)} tenants "
                f"({', '.join(sorted(self.tenants))})",
                field="namespace.tenant",
            )
        if requested not in self.tenants:
            raise PermissionDenied(
                f"namespace.tenant {requested!r} is not one of the tenants token {self.name!r} may act for",
                field="namespace.tenant",
            )
        return requested


def bind_tenant(namespace: NamespaceIdentity, caller: Principal | None) -> NamespaceIdentity:
    """``namespace`` with the tenant the caller acts for; unchanged while auth is off (None)."""
    if caller is None:
        return namespace
    tenant = caller.tenant_for(namespace.tenant)
    return namespace if tenant == namespace.tenant else dataclasses.replace(namespace, tenant=tenant)


# -- tokens ----------------------------------------------------------------------------------


def new_token() -> str:
    """A fresh bearer token: 256 random bits, URL-safe, recognisable by its prefix."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The SHA-256 hex digest a token table stores for ``token``."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def read_token_file(path: Path, *, field: str = "auth_token_file") -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped); errors name ``field``."""
    try:
        token = path.expanduser().read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {field} {path}: {exc.strerror}", field=field) from exc
    if not token:
        raise ConfigError(f"{field} {path} is empty; it must hold one bearer token", field=field)
    return token


@dataclass(frozen=True, slots=True)
class TokenEntry:
    name: str
    role: Role
    tenants: frozenset[str]
    sha256: str
    worker_id: str | None = None

    @property
    def principal(self) -> Principal:
        return Principal(self.name, self.role, self.tenants, self.worker_id, bytes.fromhex(self.sha256))

    def as_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": self.name, "role": self.role.value}
        if self.tenants:
            entry["tenants"] = sorted(self.tenants)
        if self.worker_id is not None:
            entry["worker_id"] = self.worker_id
        entry["sha256"] = self.sha256
        return entry


class TokenTable:
    """Bearer tokens by hash. ``authenticate`` compares against every entry in constant time."""

    def __init__(self, entries: Iterable[TokenEntry], *, source: str = "<memory>") -> None:
        self.entries = tuple(entries)
        self.source = source
        _check_unique(self.entries, source)
        self._digests = [(bytes.fromhex(e.sha256), e.principal) for e in self.entries]

    def __len__(self) -> int:
        return len(self.entries)

    def authenticate(self, token: str) -> Principal | None:
        """The principal ``token`` stands for, or None for an unknown token."""
        digest = hashlib.sha256(token.encode("utf-8", "replace")).digest()
        found: Principal | None = None
        for stored, principal in self._digests:  # no early exit: the time does not tell which entry
            if hmac.compare_digest(stored, digest):
                found = principal
        return found


def make_entry(name: str, role: str, tenants: Sequence[str], sha256: str, *, where: str = "entry",
               worker_id: str | None = None) -> TokenEntry:
    """A validated entry; errors name ``where`` and the field (``tokens[2].tenants``)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            f"{where}.name must be 1-128 characters of letters, digits and _.@:- starting with a "
            f"letter or digit, got {name!r}",
            field=f"{where}.name",
        )
    if role not in ROLES:
        raise ConfigError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", field=f"{where}.role")
    if isinstance(tenants, str) or not isinstance(tenants, Sequence | frozenset | set):
        raise ConfigError(f"{where}.tenants must be a list of tenant names, got {tenants!r}",
                          field=f"{where}.tenants")
    for tenant in tenants:
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"{where}.tenants must hold non-empty strings, got {tenant!r}",
                              field=f"{where}.tenants")
    if role == Role.FRONTEND and not tenants:
        raise ConfigError(
            f"{where}.tenants must name at least one tenant: a frontend token acts only for its tenants",
            field=f"{where}.tenants",
        )
    if role != Role.FRONTEND and tenants:
        raise ConfigError(
            f"{where}.tenants is for frontend tokens only ({role} tokens are not bound to tenants)",
            field=f"{where}.tenants",
        )
    _check_worker_id(role, worker_id, where)
    if not isinstance(sha256, str) or not _SHA256_RE.match(sha256):
        raise ConfigError(
            f"{where}.sha256 must be 64 lowercase hex digits (the SHA-256 of the token; "
            "`kvtier token hash` prints it)",
            field=f"{where}.sha256",
        )
    return TokenEntry(name, Role(role), frozenset(tenants), sha256, worker_id)


def _check_worker_id(role: str, worker_id: Any, where: str) -> None:
    """A worker token names the one worker id it may register; other roles name none."""
    if role != Role.WORKER:
        if worker_id is not None:
            raise ConfigError(f"{where}.worker_id is for worker tokens only ({role} tokens register no worker)",
                              field=f"{where}.worker_id")
        return
    if worker_id is None:
        raise ConfigError(
            f"{where}.worker_id is required for a worker token: each worker has its own token, bound to "
            "its worker id (`kvtier token create --role worker --worker-id ID`)",
            field=f"{where}.worker_id",
        )
    if not isinstance(worker_id, str) or not _WORKER_ID_RE.match(worker_id):
        raise ConfigError(
            f"{where}.worker_id must be 1-128 characters of letters, digits and _.@:- starting with a "
            f"letter or digit, got {worker_id!r}",
            field=f"{where}.worker_id",
        )


def _check_unique(entries: Sequence[TokenEntry], source: str) -> None:
    names: dict[str, int] = {}
    digests: dict[str, int] = {}
    for i, e in enumerate(entries):
        if e.name in names:
            raise ConfigError(
                f"token table {source}: tokens[{i}].name {e.name!r} repeats tokens[{names[e.name]}]",
                field=f"tokens[{i}].name",
            )
        if e.sha256 in digests:
            raise ConfigError(
                f"token table {source}: tokens[{i}].sha256 repeats tokens[{digests[e.sha256]}] "
                "(one token, two entries)",
                field=f"tokens[{i}].sha256",
            )
        names[e.name], digests[e.sha256] = i, i


def parse_token_table(data: Any, *, source: str = "<memory>") -> TokenTable:
    """A table from a parsed file: a mapping with a ``tokens`` list of entry mappings."""
    if not isinstance(data, Mapping) or set(data) != {"tokens"}:
        keys = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise ConfigError(
            f"token table {source} must hold exactly one key, tokens (a list of entries), got {keys}",
            field="tokens",
        )
    raw = data["tokens"]
    if not isinstance(raw, list):
        raise ConfigError(f"token table {source}: tokens must be a list of entries", field="tokens")
    entries = []
    for i, item in enumerate(raw):
        where = f"tokens[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"token table {source}: {where} must be a mapping", field=where)
        if "token" in item:
            raise ConfigError(
                f"token table {source}: {where} holds a raw token; store only its hash as sha256 "
                "(`kvtier token hash` prints it)",
                field=f"{where}.token",
            )
        unknown = sorted(set(item) - _ENTRY_KEYS)
        if unknown:
            raise ConfigError(
                f"token table {source}: {where} has unknown key(s) {', '.join(map(str, unknown))}; "
                f"known: {', '.join(sorted(_ENTRY_KEYS))}",
                field=f"{where}.{unknown[0]}",
            )
        for key in ("name", "role", "sha256"):
            if key not in item:
                raise ConfigError(f"token table {source}: {where}.{key} is missing", field=f"{where}.{key}")
        try:
            entries.append(make_entry(item["name"], item["role"], item.get("tenants") or [], item["sha256"],
                                      where=where, worker_id=item.get("worker_id")))
        except ConfigError as err:
            raise ConfigError(f"token table {source}: {err.message}", field=err.field) from None
    return TokenTable(entries, source=source)


def _read_table_data(path: Path) -> Any:
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"token table {path} must end in .toml, .yaml or .yml", field="tokens")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read token table {path}: {exc.strerror}", field="tokens") from exc
    try:
        return tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"token table {path} is not valid {suffix[1:].upper()}: {exc}", field="tokens") from exc


def load_token_table(path: Path) -> TokenTable:
    """Read and validate a token table file; ``ConfigError`` names the entry and field."""
    path = path.expanduser()
    data = _read_table_data(path)
    if data is None:
        data = {"tokens": []}
    return parse_token_table(data, source=str(path))


def dump_token_table(entries: Iterable[TokenEntry], path: Path) -> None:
    """Write ``entries`` as ``path``'s format (YAML or TOML) holds them, owner-only (0600)."""
    items = [e.as_dict() for e in entries]
    if path.suffix.lower() == ".toml":
        lines = []
        for item in items:
            lines.append("[[tokens]]")
            for key, value in item.items():
                lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        text = "\n".join(lines)
    else:
        text = yaml.safe_dump({"tokens": items}, sort_keys=False)
    write_secret_file(path, text)  # a table of credentials: 0600 whoever writes it, replaced atomically


def _toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def append_entry(path: Path, entry: TokenEntry) -> TokenTable:
    """Add ``entry`` to the table at ``path`` (created when missing); returns the new table."""
    path = path.expanduser()
    existing = load_token_table(path).entries if path.exists() else ()
    table = TokenTable((*existing, entry), source=str(path))  # checks name and hash uniqueness
    path.parent.mkdir(parents=True, exist_ok=True)
    dump_token_table(table.entries, path)
    return table


class TokenTableFile:
    """A token table that follows its file: re-read when the file changes, checked at most
    every ``reload_interval_s``, so a revoked token stops working without a restart.

    A changed file that does not validate is refused (logged) and the previous table stays
    in force: a typo must not lock every caller out or let everyone in.
    """

    def __init__(self, path: Path, *, reload_interval_s: float = 1.0) -> None:
        self.path = path.expanduser()
        self.reload_interval_s = reload_interval_s
        self.table = load_token_table(self.path)
        self._stamp = self._stat()
        self._checked_at = time.monotonic()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def current(self) -> TokenTable:
        now = time.monotonic()
        if now - self._checked_at >= self.reload_interval_s:
            self._checked_at = now
            stamp = self._stat()
            if stamp != self._stamp and stamp is not None:
                self._stamp = stamp
                try:
                    self.table = load_token_table(self.path)
                    log.info("token table reloaded", extra={"path": str(self.path), "num_tokens": len(self.table)})
                except ConfigError as err:
                    log.error("token table change refused; the previous table stays in force",
                              extra={"path": str(self.path), "reason": err.message})
        return self.table

    def authenticate(self, token: str) -> Principal | None:
        return self.current().authenticate(token)
