"""Typed configuration: one frozen dataclass per process, built once at start-up (STYLE 9).

    flags (overrides)  >  KVTIER_<FIELD> environment  >  file (.toml / .yaml)  >  defaults

Every field carries a ``Setting`` in its metadata: a help line and the accepted range or
choices. ``load_config`` coerces strings (env vars are always strings) to the field's
type, then checks each value where it came from, so an error names the field, what is
accepted and the source: "page_size must be a power of two in [1, 1024], got 12 (from
KVTIER_PAGE_SIZE)". Cross-field rules live in each class's ``check()``.

Sizes in bytes also accept units from strings: ``80GiB``, ``512Mi`` (binary) or
``2TB`` (decimal), as in Kubernetes quantities.

Structured settings (a type with a ``from_setting`` classmethod, e.g. ``tenant_quotas``)
take a table or list in the file, and YAML/JSON flow text from env vars and flags:
``KVTIER_TENANT_QUOTAS='{acme: {hbm: 64}}'``; their errors name the entry ("tenant_quotas.acme.hbm").
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from kvtier.cache.quotas import QuotaTable
from kvtier.cache.ttls import TtlTable
from kvtier.domain.errors import ConfigError
from kvtier.domain.hashing import KV_DTYPES
from kvtier.domain.sizes import SizeError, parse_size
from kvtier.runtime.log import LOG_LEVELS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "KVTIER_"
# What --kv-cache-dtype takes (vLLM's spellings for FP8); fp4 is refused at start (no engine format).
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_DTYPES, "fp8_e4m3", "fp8_e5m2")
_SETTING = "kvtier.setting"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none", "null"})
# The most ``WorkerConfig.wait_scale`` may stretch the worker's fixed waits (worker.engine_loop).
MAX_WAIT_SCALE = 100.0
# The longest hold on a prefetched session's pages (``ControllerConfig.session_hold_max_s``;
# ``OrchestratorParams.max_hold_ms`` of an orchestrator built without a configuration).
DEFAULT_SESSION_HOLD_MAX_S = 10.0
DEFAULT_MAX_SESSIONS_PER_TENANT = 1000

C = TypeVar("C", bound="DataclassInstance")


@dataclass(frozen=True, slots=True)
class Setting:
    """What one field accepts. Bounds are inclusive unless ``min_open``."""

    help: str
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    choices: tuple[str, ...] = ()
    power_of_two: bool = False
    is_size: bool = False

    def accepts(self, value: Any) -> bool:
        if value is None:
            return True  # only Optional fields can hold None; coercion guarantees that
        if isinstance(value, tuple):
            return all(self.accepts(item) for item in value)
        if self.choices:
            return value in self.choices
        if isinstance(value, int | float) and not isinstance(value, bool):
            if isinstance(value, float) and math.isnan(value):
                return False
            if self.min is not None and (value <= self.min if self.min_open else value < self.min):
                return False
            if self.max is not None and value > self.max:
                return False
            if self.power_of_two and (value < 1 or int(value) & (int(value) - 1)):
                return False
        return True

    def describe(self) -> str:
        """The accepted values in words, as error messages and help texts show them."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        lo, hi = _number(self.min), _number(self.max)
        if self.min is not None and self.max is not None:
            bounds = f"in {'(' if self.min_open else '['}{lo}, {hi}]"
        elif self.min is not None:
            bounds = f"{'>' if self.min_open else '>='} {lo}"
        elif self.max is not None:
            bounds = f"<= {hi}"
        else:
            bounds = ""
        return f"a power of two {bounds}".strip() if self.power_of_two else bounds


def setting(default: Any, help: str, **accepted: Any) -> Any:
    """A dataclass field with its ``Setting``; ``accepted`` holds Setting's range keywords."""
    return dataclasses.field(default=default, metadata={_SETTING: Setting(help, **accepted)})


def _number(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str | Path) else str(value)


def _log_level() -> Any:
    return setting("info", "log verbosity", choices=tuple(LOG_LEVELS))


def _log_json() -> Any:
    return setting(False, "write logs as one JSON object per line")


def _metrics_port() -> Any:
    return setting(None, "Prometheus endpoint port; unset serves no metrics", min=0, max=65535)


def _otlp_endpoint() -> Any:
    return setting(
        None, "OTLP/gRPC collector address (e.g. http://otel-collector:4317) for spans and metrics; "
        "needs the kvtier[otlp] extra; unset: no OTLP export",
    )


def _state_dir() -> Any:
    return setting(Path("~/.kvtier"), "directory for embedded Redis data, NVMe page files and logs")


def _allow_unauthenticated() -> Any:
    return setting(
        False, "serve callers without a token on a non-loopback address (only where the network admits callers)"
    )


def _tls_cert_file() -> Any:
    return setting(None, "PEM certificate chain; with tls_key_file the server speaks TLS only")


def _tls_key_file() -> Any:
    return setting(None, "PEM private key of tls_cert_file")


def _tls_client_ca_file() -> Any:
    return setting(None, "PEM CA bundle; set: every caller must present a certificate it signed (mTLS)")


def _check_tls(config: Any, *, client_ca: bool) -> None:
    """The file pairs TLS needs, checked at start-up (the files themselves: kvtier.rpc.tls)."""
    if (config.tls_cert_file is None) != (config.tls_key_file is None):
        missing = "tls_key_file" if config.tls_key_file is None else "tls_cert_file"
        raise ConfigError(f"tls_cert_file and tls_key_file go together; set {missing} too", field=missing)
    if client_ca and config.tls_client_ca_file is not None and config.tls_cert_file is None:
        raise ConfigError(
            "tls_client_ca_file needs tls_cert_file and tls_key_file: client certificates are checked "
            "only on a TLS server",
            field="tls_client_ca_file",
        )


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    host: str = setting("127.0.0.1", "address the gRPC server listens on (0.0.0.0 for every interface)")
    port: int = setting(50051, "gRPC port; 0 picks a free one", min=0, max=65535)
    redis_url: str | None = setting(None, "Redis or Valkey URL; unset starts an embedded Valkey in state_dir")
    state_dir: Path = _state_dir()
    lease_ttl_s: float = setting(
        3.0, "a worker whose lease is this old is treated as gone", min=0, max=600, min_open=True
    )
    heartbeat_interval_s: float = setting(
        1.0, "how often workers are told to renew their lease", min=0, max=60, min_open=True
    )
    tier_weight_hbm: float = setting(1.0, "routing value of a matched token already in HBM", min=0, max=1)
    tier_weight_dram: float = setting(0.8, "routing value of a matched token in DRAM", min=0, max=1)
    tier_weight_nvme: float = setting(0.5, "routing value of a matched token on NVMe", min=0, max=1)
    route_by_ttft: bool = setting(
        False, "rank workers by estimated time to first token (queue, promotion, peer fetch, prefill, from the "
        "rates workers measure) and send a peer-fetch plan with the pick that needs a peer's pages"
    )
    drain_migrate_bytes: int = setting(
        4 << 30, "most bytes a drain copies to peers (pinned prefixes first) before it drops the worker's cache; "
        "0: a drain drops everything", min=0,
    )
    replica_check_interval_s: float = setting(
        2.0, "how often pins with --replicas are checked for lost or drained holders", min=0.05, max=3600,
    )
    session_hold_max_s: float = setting(
        DEFAULT_SESSION_HOLD_MAX_S, "longest a worker holds a paused session's prefetched pages in HBM for its return (the hold "
        "ends at the predicted return's 99 % point, at most this); raise it for tools that run minutes; 0: no hold",
        min=0, max=3600,
    )
    auth_token_file: Path | None = setting(
        None, "token table (YAML/TOML: name, role, tenants, sha256 per token; see kvtier.rpc.auth); unset disables auth"
    )
    max_sessions_per_tenant: int = setting(
        DEFAULT_MAX_SESSIONS_PER_TENANT, "live sessions one tenant may have; a Route or Pause starting one more is "
        "RESOURCE_EXHAUSTED", min=1, max=10_000_000,
    )
    # Per-credential limits (authentication on; docs/decisions/0007-authentication.md): each
    # credential's calls per second (a burst of two seconds' worth) and calls in flight per
    # service; 0: unlimited.
    route_calls_per_s: float = setting(1000.0, "Route and ListModels calls per second per credential; 0: unlimited",
                                       min=0, max=1e7)
    route_bytes_per_s: float = setting(
        8 * 2**20, "Route request bytes per second per credential (a 1,048,576-token Route is 3-5 MiB); 0: unlimited",
        min=0, max=1e12,
    )
    route_in_flight: int = setting(32, "Route and ListModels calls in flight per credential; 0: unlimited",
                                   min=0, max=100_000)
    sessions_calls_per_s: float = setting(1000.0, "Sessions calls (Pause, Returning, End) per second per credential; "
                                          "0: unlimited", min=0, max=1e7)
    sessions_in_flight: int = setting(32, "Sessions calls in flight per credential; 0: unlimited", min=0, max=100_000)
    admin_calls_per_s: float = setting(50.0, "Admin calls per second per credential; 0: unlimited", min=0, max=1e7)
    admin_in_flight: int = setting(8, "Admin calls in flight per credential; 0: unlimited", min=0, max=100_000)
    allow_unauthenticated: bool = _allow_unauthenticated()
    route_ticket_ttl_s: float = setting(
        30.0, "how long a Route ticket lets its frontend start a Generate on the ticket's worker (with auth)",
        min=1, max=3600,
    )
    tls_cert_file: Path | None = _tls_cert_file()
    tls_key_file: Path | None = _tls_key_file()
    tls_client_ca_file: Path | None = _tls_client_ca_file()
    tls_ca_file: Path | None = setting(
        None, "PEM CA bundle of the workers' certificates: the controller dials workers over TLS for address "
        "proofs (presenting tls_cert_file); unset dials them in plaintext",
    )
    health_port: int | None = setting(
        None, "plaintext port serving only grpc.health.v1, for probes that cannot speak TLS; unset: none",
        min=0, max=65535,
    )
    metrics_port: int | None = _metrics_port()
    otlp_endpoint: str | None = _otlp_endpoint()
    log_level: str = _log_level()
    log_json: bool = _log_json()

    def check(self) -> None:
        _check_tls(self, client_ca=True)
        # A live worker renews at least twice per TTL, so one late heartbeat never expires it.
        if self.heartbeat_interval_s * 2 > self.lease_ttl_s:
            raise ConfigError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s:g}) must be at most half of "
                f"lease_ttl_s ({self.lease_ttl_s:g}) so one late heartbeat does not expire a live worker",
                field="heartbeat_interval_s",
            )


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    host: str = setting("127.0.0.1", "address the worker's gRPC server listens on")
    port: int = setting(
        0, "gRPC port; 0 picks a free one (the worker registers its address)", min=0, max=65535
    )
    controller_address: str = setting("127.0.0.1:50051", "host:port of the controller")
    model: Path | None = setting(None, "checkpoint directory; unset creates a small random-weight model")
    device: str = setting("auto", "where the model and the HBM tier live", choices=("auto", "cpu", "cuda"))
    page_size: int = setting(16, "tokens per KV page", min=1, max=1024, power_of_two=True)
    kv_cache_dtype: str = setting(
        "auto",
        "KV element type; auto is fp32 on CPU, bf16 on GPU; fp8 (= fp8_e4m3) or fp8_e5m2 stores FP8 codes with "
        "per-(page, layer, plane, kv head) scales in every tier (decision 0015)",
        choices=KV_CACHE_DTYPE_CHOICES,
    )
    lower_tier_dtype: str = setting(
        "same",
        "what pages hold below HBM: same as kv_cache_dtype, or fp8 (fp8_e4m3, fp8_e5m2) for a float HBM cache that "
        "demotes as FP8 (requantized on the way down: changes output, and the namespace says so)",
        choices=("same", "fp8", "fp8_e4m3", "fp8_e5m2"),
    )
    gpu_memory_utilization: float = setting(
        0.9, "share of device memory for weights + KV when hbm_bytes is unset", min=0, max=1, min_open=True
    )
    hbm_bytes: int | None = setting(
        None, "HBM tier budget; unset derives it from gpu_memory_utilization", min=1, is_size=True
    )
    dram_bytes: int = setting(1 << 30, "DRAM tier budget (host memory)", min=0, is_size=True)
    nvme_bytes: int = setting(0, "NVMe tier budget; 0 disables the tier", min=0, is_size=True)
    nvme_dir: Path | None = setting(None, "directory for NVMe page files; unset uses state_dir/nvme")
    max_model_len: int | None = setting(None, "longest sequence; unset uses the model's limit", min=1)
    # Link emulation (kvtier.tiers.transfer's doc, decision 0011): a hardware stand-in for benchmarks
    # on machines without a GPU, where "HBM" is host memory and its links cost nothing.
    emulated_dram_link_bytes_per_s: float | None = setting(
        None,
        "benchmarks without a GPU only: emulate a PCIe link of this many bytes/s for HBM <-> DRAM "
        "transfers (none completes sooner than bytes / rate after it starts); unset: no emulation",
        min=0, min_open=True,
    )
    emulated_nvme_link_bytes_per_s: float | None = setting(
        None,
        "benchmarks without a GPU only: emulate a link of this many bytes/s for HBM <-> NVMe transfers "
        "(DRAM <-> NVMe is the real disk, never emulated); unset: no emulation",
        min=0, min_open=True,
    )
    emulated_peer_link_bytes_per_s: float | None = setting(
        None,
        "benchmarks on one machine only: emulate a network link of this many bytes/s for page groups this "
        "worker exports to peers (none is handed over sooner than bytes / rate); unset: no emulation",
        min=0, min_open=True,
    )
    session_hold_fraction: float = setting(
        1.0,
        "share of HBM the pages of paused sessions kept or prefetched for their next turn may hold together; "
        "higher can waste fewer prefetches, lower leaves more room for the other sessions' turns (decision 0008)",
        min=0, max=1, min_open=True,
    )
    wait_scale: float = setting(
        1.0,
        "multiplies the worker's fixed waits (a request's wait for room and pages, 5 s; a prefetch's for room, 1 s; "
        "a demotion's for pages already leaving, 0.5 s; holds due back within 1 s spared for 2 s): for an engine "
        "whose turns take that many times longer, e.g. a benchmark slowed down to a CPU's pace",
        min=0, max=MAX_WAIT_SCALE, min_open=True,
    )
    # The names of kvtier.cache.eviction.POLICY_NAMES (not imported here: that module loads torch).
    eviction_policy: str = setting(
        "experts",
        "which cached pages leave a tier first: experts (recency, reuse-time and turnover-frequency experts; "
        "the one measured best on this workload leads, LRU until another is), value (restore cost x reuse, "
        "per byte), or lru",
        choices=("value", "lru", "experts"),
    )
    state_dir: Path = _state_dir()
    auth_token_file: Path | None = setting(None, "file holding this worker's bearer token (role worker)")
    auth_tokens_file: Path | None = setting(
        None, "token table of the callers this worker serves (the controller's format); unset disables auth"
    )
    allow_unauthenticated: bool = _allow_unauthenticated()
    tls_cert_file: Path | None = setting(
        None, "PEM certificate chain of the worker's server (TLS), also its client certificate to the controller"
    )
    tls_key_file: Path | None = _tls_key_file()
    tls_client_ca_file: Path | None = _tls_client_ca_file()
    tls_ca_file: Path | None = setting(None, "PEM CA bundle that signed the controller's certificate; set: dial it over TLS")
    tls_server_name: str | None = setting(None, "name to check the controller's certificate for (default: its host)")
    tenant_quotas: QuotaTable = setting(
        QuotaTable(),
        "cached pages a tenant may keep per tier, e.g. {acme: {hbm: 256, dram: 4GiB}, '*': {hbm: 64}} "
        "('*': tenants not listed; a number is pages, a size is bytes; see kvtier.cache.quotas); unset: no quotas",
    )
    namespace_ttls: TtlTable = setting(
        TtlTable(),
        "seconds an idle cached page lives, per namespace: [{tenant: acme, model_id: m, ttl_s: 60}, {ttl_s: 3600}] "
        "(the most specific rule wins; 0: no TTL; see kvtier.cache.ttls); unset: no TTLs",
    )
    metrics_port: int | None = _metrics_port()
    otlp_endpoint: str | None = _otlp_endpoint()
    log_level: str = _log_level()
    log_json: bool = _log_json()

    @property
    def emulated_link_bytes_per_s(self) -> dict[str, float]:
        """The emulated links by lower tier ("dram", "nvme"); {} when emulation is off."""
        rates = {"dram": self.emulated_dram_link_bytes_per_s, "nvme": self.emulated_nvme_link_bytes_per_s}
        return {tier: rate for tier, rate in rates.items() if rate is not None}

    def check(self) -> None:
        _check_tls(self, client_ca=True)
        # Also for configs built directly (kvtier.local.stack), which skip load_config's range check.
        for name in ("emulated_dram_link_bytes_per_s", "emulated_nvme_link_bytes_per_s",
                     "emulated_peer_link_bytes_per_s"):
            rate = getattr(self, name)
            if rate is not None and not (
                isinstance(rate, int | float) and not isinstance(rate, bool) and math.isfinite(rate) and rate > 0
            ):
                raise ConfigError(f"{name} must be a positive, finite number of bytes/s, got {rate!r}", field=name)
        for name in ("session_hold_fraction", "wait_scale"):
            value = getattr(self, name)
            spec = next(_setting(f) for f in dataclasses.fields(self) if f.name == name)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and spec.accepts(value)):
                raise ConfigError(f"{name} must be {spec.describe()}, got {value!r}", field=name)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    controller_address: str = setting("127.0.0.1:50051", "host:port of the controller")
    auth_token_file: Path | None = setting(None, "file holding this client's bearer token")
    tls_ca_file: Path | None = setting(None, "PEM CA bundle that signed the servers' certificates; set: dial over TLS")
    tls_cert_file: Path | None = setting(None, "PEM client certificate, for servers that require one (mTLS)")
    tls_key_file: Path | None = _tls_key_file()
    tls_server_name: str | None = setting(None, "name to check the servers' certificates for (default: their host)")
    timeout_s: float = setting(30.0, "deadline of one call", min=0, max=3600, min_open=True)
    max_retries: int = setting(3, "retries of idempotent calls on UNAVAILABLE", min=0, max=10)
    retry_backoff_s: float = setting(
        0.2, "first retry delay, doubled per retry", min=0, max=60, min_open=True
    )
    log_level: str = _log_level()
    log_json: bool = _log_json()

    def check(self) -> None:
        _check_tls(self, client_ca=False)


@dataclass(frozen=True, slots=True)
class SettingInfo:
    """One field as people see it, for help texts and documentation."""

    name: str
    env_var: str
    flag: str
    default: Any
    accepted: str
    help: str


def settings_of(cls: type) -> tuple[SettingInfo, ...]:
    return tuple(
        SettingInfo(
            name=f.name,
            env_var=ENV_PREFIX + f.name.upper(),
            flag="--" + f.name.replace("_", "-"),
            default=f.default,
            accepted=_setting(f).describe(),
            help=_setting(f).help,
        )
        for f in dataclasses.fields(cls)
    )


def _setting(f: dataclasses.Field[Any]) -> Setting:
    return f.metadata.get(_SETTING) or Setting(help="")


class _CoercionError(Exception):
    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


def _parse_size(text: str) -> int:
    try:
        return parse_size(text)
    except SizeError as exc:
        raise _CoercionError(exc.expected) from None


def _coerce(value: Any, hint: Any, spec: Setting) -> Any:
    """``value`` (a string from env/flags, or a file's scalar) as an instance of ``hint``."""
    args = typing.get_args(hint)
    from_setting = getattr(hint, "from_setting", None)
    if from_setting is not None:  # a structured setting: it validates itself (errors name the entry)
        if isinstance(value, hint):
            return value
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise _CoercionError("YAML or JSON text (a table or a list)") from None
        return from_setting(value)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _coerce(value, hint, spec)
    if typing.get_origin(hint) is tuple:
        items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise _CoercionError("a list (comma-separated in env vars and flags)")
        return tuple(_coerce(item, args[0], spec) for item in items)
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise _CoercionError("true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            if spec.is_size:
                return _parse_size(value)
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise _CoercionError("an integer")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        try:
            return float(str(value).strip())
        except ValueError:
            raise _CoercionError("a number") from None
    if hint is Path:
        if isinstance(value, str | Path):
            return Path(value).expanduser()
        raise _CoercionError("a path")
    if hint is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise _CoercionError("a string")
    raise TypeError(f"config fields of type {hint!r} are not supported")


def _read_file(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"config file {path} must end in .toml, .yaml or .yml", field="config")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}", field="config") from exc
    try:
        data = tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"config file {path} is not valid {suffix[1:].upper()}: {exc}", field="config"
        ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of setting names to values", field="config"
        )
    return data


def _unknown(key: str, names: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key.replace("-", "_"), names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known settings: {', '.join(names)}"
    return ConfigError(f"unknown setting {key!r} {where}{hint}", field=key)


def load_config(
    cls: type[C],
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """Build and validate ``cls`` from defaults, a file, ``KVTIER_*`` variables and flags.

    ``overrides`` are flag values by field name; ``None`` means the flag was not given.
    Unknown keys in the file or in ``overrides`` are errors; unrelated ``KVTIER_*``
    variables are ignored because every process shares the prefix.
    """
    env = os.environ if env is None else env
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields)
    raw: dict[str, tuple[Any, str]] = {name: (f.default, "default") for name, f in fields.items()}
    if file is not None:
        path = Path(file).expanduser()
        for key, value in _read_file(path).items():
            if key not in fields:
                raise _unknown(key, names, f"in config file {path}")
            raw[key] = (value, f"from {path}")
    for name in names:
        if (value := env.get(ENV_PREFIX + name.upper())) is not None:
            raw[name] = (value, f"from {ENV_PREFIX}{name.upper()}")
    for key, value in (overrides or {}).items():
        if key not in fields:
            raise _unknown(key, names, "in overrides")
        if value is not None:
            raw[key] = (value, f"from --{key.replace('_', '-')}")

    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, (value, source) in raw.items():
        spec = _setting(fields[name])
        try:
            coerced = _coerce(value, hints[name], spec)
        except _CoercionError as exc:
            raise ConfigError(
                f"{name} must be {exc.expected}, got {_show(value)} ({source})", field=name
            ) from None
        except ConfigError as exc:  # a structured setting named the entry; add where it came from
            raise ConfigError(f"{exc.message} ({source})", field=exc.field) from None
        if not spec.accepts(coerced):
            raise ConfigError(
                f"{name} must be {spec.describe()}, got {_show(coerced)} ({source})", field=name
            )
        values[name] = coerced
    config = cls(**values)
    check = getattr(config, "check", None)
    if check is not None:
        check()
    return config
