"""Configuration loading: precedence, coercion from strings, and errors that name field and source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.domain.errors import ConfigError
from kvtier.runtime.config import (
    ClientConfig,
    ControllerConfig,
    WorkerConfig,
    load_config,
    setting,
    settings_of,
)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults() -> None:
    worker = load_config(WorkerConfig, env={})
    assert worker.page_size == 16
    assert worker.gpu_memory_utilization == 0.9
    assert worker.kv_cache_dtype == "auto"
    assert worker.hbm_bytes is None and worker.nvme_bytes == 0
    assert worker.state_dir == Path("~/.kvtier").expanduser()
    controller = load_config(ControllerConfig, env={})
    assert (controller.lease_ttl_s, controller.heartbeat_interval_s) == (3.0, 1.0)
    assert controller.redis_url is None  # embedded Valkey
    assert load_config(ClientConfig, env={}).timeout_s == 30.0


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    file = write(tmp_path / "worker.toml", "page_size = 32\nport = 7000\nlog_level = 'debug'\n")
    env = {"KVTIER_PAGE_SIZE": "64", "KVTIER_PORT": "7001"}
    config = load_config(WorkerConfig, file=file, env=env, overrides={"page_size": 128, "port": None})
    assert config.page_size == 128  # flag
    assert config.port == 7001  # env; a flag of None means "not given"
    assert config.log_level == "debug"  # file
    assert config.dram_bytes == 1 << 30  # default
    assert load_config(WorkerConfig, file=file, env=env).page_size == 64
    assert load_config(WorkerConfig, file=file, env={}).page_size == 32


def test_yaml_file(tmp_path: Path) -> None:
    file = write(tmp_path / "controller.yaml", "redis_url: redis://10.0.0.5:6379/0\nlease_ttl_s: 10\n")
    config = load_config(ControllerConfig, file=file, env={})
    assert config.redis_url == "redis://10.0.0.5:6379/0"
    assert config.lease_ttl_s == 10.0 and isinstance(config.lease_ttl_s, float)
    assert load_config(ControllerConfig, file=write(tmp_path / "empty.yml", ""), env={}) == config.__class__(
        state_dir=Path("~/.kvtier").expanduser()
    )


def test_coercion_from_strings(tmp_path: Path) -> None:
    env = {
        "KVTIER_PORT": "8080",
        "KVTIER_LOG_JSON": "yes",
        "KVTIER_GPU_MEMORY_UTILIZATION": "0.5",
        "KVTIER_DRAM_BYTES": "4GiB",
        "KVTIER_NVME_BYTES": "2TB",
        "KVTIER_HBM_BYTES": "512Mi",
        "KVTIER_MODEL": "~/ckpt",
        "KVTIER_MAX_MODEL_LEN": "none",
        "KVTIER_NVME_DIR": str(tmp_path),
    }
    config = load_config(WorkerConfig, env=env)
    assert config.port == 8080
    assert config.log_json is True
    assert config.gpu_memory_utilization == 0.5
    assert config.dram_bytes == 4 << 30
    assert config.nvme_bytes == 2 * 10**12
    assert config.hbm_bytes == 512 << 20
    assert config.model == Path.home() / "ckpt"
    assert config.max_model_len is None
    assert config.nvme_dir == tmp_path
    assert load_config(ControllerConfig, env={"KVTIER_REDIS_URL": ""}).redis_url is None
    assert load_config(ClientConfig, env={"KVTIER_LOG_JSON": "OFF"}).log_json is False


@dataclass(frozen=True, slots=True)
class Sample:
    names: tuple[str, ...] = setting((), "names")
    ports: tuple[int, ...] = setting((), "ports", min=1, max=65535)


def test_tuple_coercion() -> None:
    config = load_config(Sample, env={"KVTIER_NAMES": "a, b,c", "KVTIER_PORTS": "80,443"})
    assert config == Sample(names=("a", "b", "c"), ports=(80, 443))
    assert load_config(Sample, env={}, overrides={"ports": [1, 2]}).ports == (1, 2)
    with pytest.raises(
        ConfigError, match=r"ports must be in \[1, 65535\], got \(80, 0\) \(from KVTIER_PORTS\)"
    ):
        load_config(Sample, env={"KVTIER_PORTS": "80,0"})


def test_out_of_range_names_field_range_and_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(WorkerConfig, env={"KVTIER_PAGE_SIZE": "12"})
    assert str(info.value) == "page_size must be a power of two in [1, 1024], got 12 (from KVTIER_PAGE_SIZE)"
    assert info.value.field == "page_size"

    file = write(tmp_path / "w.toml", "gpu_memory_utilization = 1.5\n")
    with pytest.raises(ConfigError) as info:
        load_config(WorkerConfig, file=file, env={})
    assert str(info.value) == f"gpu_memory_utilization must be in (0, 1], got 1.5 (from {file})"

    with pytest.raises(ConfigError) as info:
        load_config(ClientConfig, env={}, overrides={"log_level": "loud"})
    assert (
        str(info.value)
        == "log_level must be one of debug, info, warning, error, got 'loud' (from --log-level)"
    )

    with pytest.raises(ConfigError, match=r"port must be in \[0, 65535\], got 70000"):
        load_config(ControllerConfig, env={"KVTIER_PORT": "70000"})
    with pytest.raises(ConfigError, match=r"dram_bytes must be >= 0, got -1 \(from KVTIER_DRAM_BYTES\)"):
        load_config(WorkerConfig, env={"KVTIER_DRAM_BYTES": "-1"})
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp32, fp16, bf16, fp8, fp4"):
        load_config(WorkerConfig, env={"KVTIER_KV_CACHE_DTYPE": "int8"})
    with pytest.raises(ConfigError, match=r"lease_ttl_s must be in \(0, 600\], got 0.0"):
        load_config(ControllerConfig, env={"KVTIER_LEASE_TTL_S": "0"})
    with pytest.raises(ConfigError, match=r"session_hold_max_s must be in \[0, 3600\], got -1.0 \(from KVTIER_SESSION_HOLD_MAX_S\)"):
        load_config(ControllerConfig, env={"KVTIER_SESSION_HOLD_MAX_S": "-1"})
    assert load_config(ControllerConfig, env={"KVTIER_SESSION_HOLD_MAX_S": "120"}).session_hold_max_s == 120.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVTIER_PAGE_SIZE": "abc"}, "page_size must be an integer, got 'abc' (from KVTIER_PAGE_SIZE)"),
        ({"KVTIER_PAGE_SIZE": "16.5"}, "page_size must be an integer, got '16.5'"),
        ({"KVTIER_LOG_JSON": "maybe"}, "log_json must be true or false, got 'maybe'"),
        ({"KVTIER_GPU_MEMORY_UTILIZATION": "most"}, "gpu_memory_utilization must be a number"),
        (
            {"KVTIER_DRAM_BYTES": "4XB"},
            "dram_bytes must be a size in bytes such as 4294967296, 4GiB or 512Mi",
        ),
        ({"KVTIER_DRAM_BYTES": "1.5"}, "dram_bytes must be a whole number of bytes"),
        ({"KVTIER_GPU_MEMORY_UTILIZATION": "nan"}, "gpu_memory_utilization must be in (0, 1], got nan"),
    ],
)
def test_bad_strings_name_field_and_source(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(WorkerConfig, env=env)
    assert message in str(info.value)


def test_file_values_of_the_wrong_type(tmp_path: Path) -> None:
    file = write(tmp_path / "w.toml", "page_size = 16.0\n")
    with pytest.raises(ConfigError, match=f"page_size must be an integer, got 16.0 \\(from {file}\\)"):
        load_config(WorkerConfig, file=file, env={})
    file = write(tmp_path / "w.yaml", "host: [a, b]\n")
    with pytest.raises(ConfigError, match="host must be a string"):
        load_config(WorkerConfig, file=file, env={})


def test_unknown_file_key_is_named(tmp_path: Path) -> None:
    file = write(tmp_path / "w.toml", "page-size = 32\n")
    with pytest.raises(ConfigError) as info:
        load_config(WorkerConfig, file=file, env={})
    assert "unknown setting 'page-size'" in str(info.value) and "did you mean 'page_size'?" in str(info.value)
    assert info.value.field == "page-size"
    file = write(tmp_path / "w2.yaml", "zzz: 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'zzz' .*known settings: host, port"):
        load_config(WorkerConfig, file=file, env={})
    with pytest.raises(ConfigError, match="unknown setting 'nope' in overrides"):
        load_config(WorkerConfig, env={}, overrides={"nope": 1})


def test_unrelated_env_vars_are_ignored() -> None:
    # Every process shares the KVTIER_ prefix: a controller must not trip over a worker's variables.
    assert load_config(ControllerConfig, env={"KVTIER_PAGE_SIZE": "12", "KVTIER_ANYTHING": "x"}).port == 50051


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("w.ini", "page_size = 16", "must end in .toml, .yaml or .yml"),
        ("w.toml", "page_size = ", "is not valid TOML"),
        ("w.yaml", "a: [", "is not valid YAML"),
        ("w.yaml", "- 1\n- 2\n", "must hold a mapping"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(WorkerConfig, file=write(tmp_path / name, text), env={})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(WorkerConfig, file=tmp_path / "absent.toml", env={})


def test_cross_field_check() -> None:
    with pytest.raises(
        ConfigError, match="heartbeat_interval_s \\(2\\) must be at most half of lease_ttl_s \\(3\\)"
    ):
        load_config(ControllerConfig, env={"KVTIER_HEARTBEAT_INTERVAL_S": "2"})
    config = load_config(
        ControllerConfig, env={"KVTIER_HEARTBEAT_INTERVAL_S": "2", "KVTIER_LEASE_TTL_S": "6"}
    )
    assert config.heartbeat_interval_s == 2.0


def test_settings_of_describes_every_field() -> None:
    infos = {info.name: info for info in settings_of(WorkerConfig)}
    page = infos["page_size"]
    assert (page.env_var, page.flag, page.default) == ("KVTIER_PAGE_SIZE", "--page-size", 16)
    assert page.accepted == "a power of two in [1, 1024]"
    assert infos["gpu_memory_utilization"].accepted == "in (0, 1]"
    assert infos["dram_bytes"].accepted == ">= 0"
    assert all(info.help for info in infos.values())


def test_configs_are_frozen() -> None:
    config = load_config(WorkerConfig, env={})
    with pytest.raises(AttributeError):
        config.page_size = 32  # type: ignore[misc]


def test_link_emulation_is_off_by_default_and_validated() -> None:
    config = load_config(WorkerConfig, env={})
    assert config.emulated_dram_link_bytes_per_s is None and config.emulated_nvme_link_bytes_per_s is None
    assert config.emulated_link_bytes_per_s == {}
    config = load_config(
        WorkerConfig,
        env={"KVTIER_EMULATED_NVME_LINK_BYTES_PER_S": "6.5e7"},
        overrides={"emulated_dram_link_bytes_per_s": "2.4e8"},
    )
    assert config.emulated_link_bytes_per_s == {"dram": 2.4e8, "nvme": 6.5e7}
    for bad in ("0", "-5"):
        with pytest.raises(ConfigError, match="emulated_nvme_link_bytes_per_s must be > 0") as exc:
            load_config(WorkerConfig, env={"KVTIER_EMULATED_NVME_LINK_BYTES_PER_S": bad})
        assert exc.value.field == "emulated_nvme_link_bytes_per_s"
    with pytest.raises(ConfigError, match="emulated_dram_link_bytes_per_s must be a number"):
        load_config(WorkerConfig, overrides={"emulated_dram_link_bytes_per_s": "fast"})
    with pytest.raises(ConfigError, match="positive, finite") as exc:
        load_config(WorkerConfig, env={"KVTIER_EMULATED_DRAM_LINK_BYTES_PER_S": "inf"})
    assert exc.value.field == "emulated_dram_link_bytes_per_s"
    # Built directly (as kvtier.local.stack does), check() names the field too.
    with pytest.raises(ConfigError, match="positive, finite") as exc:
        WorkerConfig(emulated_nvme_link_bytes_per_s=0.0).check()
    assert exc.value.field == "emulated_nvme_link_bytes_per_s"


def test_the_session_hold_fraction_defaults_to_the_holds_and_is_validated() -> None:
    from kvtier.worker.holds import MAX_HELD_FRACTION

    assert load_config(WorkerConfig, env={}).session_hold_fraction == MAX_HELD_FRACTION
    config = load_config(WorkerConfig, env={"KVTIER_SESSION_HOLD_FRACTION": "0.9"})
    assert config.session_hold_fraction == 0.9
    for bad in ("0", "1.01", "nan"):
        with pytest.raises(ConfigError, match=r"session_hold_fraction must be in \(0, 1\]") as exc:
            load_config(WorkerConfig, env={"KVTIER_SESSION_HOLD_FRACTION": bad})
        assert exc.value.field == "session_hold_fraction"
    # Built directly (as kvtier.local.stack does), check() names the field too.
    for bad in (0.0, 2, True):
        with pytest.raises(ConfigError, match="session_hold_fraction must be in") as exc:
            WorkerConfig(session_hold_fraction=bad).check()
        assert exc.value.field == "session_hold_fraction"


def test_worker_links_cover_both_directions() -> None:
    from kvtier.domain.tiers import Tier
    from kvtier.worker.actor import emulated_links

    config = WorkerConfig(emulated_dram_link_bytes_per_s=2e8, emulated_nvme_link_bytes_per_s=5e7)
    assert emulated_links(config) == {
        (Tier.HBM, Tier.DRAM): 2e8, (Tier.DRAM, Tier.HBM): 2e8,
        (Tier.HBM, Tier.NVME): 5e7, (Tier.NVME, Tier.HBM): 5e7,
    }
    assert emulated_links(WorkerConfig()) == {}
