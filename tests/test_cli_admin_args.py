"""The operator CLI without a controller: flag and file parsing into domain records, the one
mapping from a controller's status to a message and exit code, and the errors every command
gives when it cannot reach the controller (exit 2, one line naming the address)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from kvtier.cli import policy as cli_policy
from kvtier.cli.common import CommandFailed, Remote, jsonable, remote_error, resolve_controller
from kvtier.cli.flags import NamespaceFlags, parse_tokens, tokens_from_flags
from kvtier.cli.main import main
from kvtier.domain.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KvtierError,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from kvtier.domain.records import (
    BootId,
    ModelIdentity,
    Policy,
    SessionId,
    SessionInfo,
    SessionState,
    TierOccupancy,
    VersionedPolicy,
    Watermarks,
    WorkerId,
    WorkerInfo,
    WorkerState,
)
from kvtier.domain.tiers import Tier

COMMANDS_WITH_HELP = [
    ["status"], ["workers"], ["tiers"], ["sessions"], ["lookup"], ["invalidate"], ["drain"], ["pin"], ["unpin"],
    ["evict"], ["snapshot"], ["bench"], ["policy", "show"], ["policy", "set"], ["policy", "history"],
    ["policy", "rollback"],
]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def assert_one_line_error(code: int, out: str, err: str, expected_code: int, *needles: str) -> None:
    assert code == expected_code, err
    assert out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


@pytest.fixture
def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- policy flags and files ------------------------------------------------------------------


def test_watermark_flags_parse_into_tier_and_watermarks() -> None:
    assert cli_policy.parse_watermark("hbm=0.9:0.8") == (Tier.HBM, Watermarks(high=0.9, low=0.8))
    assert cli_policy.parse_watermark("NVMe=0.95:0.85") == (Tier.NVME, Watermarks(high=0.95, low=0.85))
    assert cli_policy.parse_watermark("dram=none") == (Tier.DRAM, None)
    assert cli_policy.parse_watermark("dram=0.5:0.5") == (Tier.DRAM, Watermarks(high=0.5, low=0.5))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("ssd=0.9:0.8", "unknown tier 'ssd'"),
        ("hbm=0.8:0.9", "low (0.9) must be <= high (0.8)"),
        ("hbm=1.5:0.8", "in [0, 1]"),
        ("hbm=0.9", "TIER=HIGH:LOW"),
        ("hbm", "TIER=VALUE"),
        ("hbm=high:low", "must be a number"),
    ],
)
def test_bad_watermark_flags_name_the_flag(text: str, needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        cli_policy.parse_watermark(text)
    assert info.value.field == "--watermark"
    assert needle in str(info.value)


def test_budget_and_weight_flags() -> None:
    assert cli_policy.parse_budget("dram=256MiB") == (Tier.DRAM, 256 << 20)
    assert cli_policy.parse_budget("dram=256MiB/s") == (Tier.DRAM, 256 << 20)
    assert cli_policy.parse_budget("nvme=2GB") == (Tier.NVME, 2_000_000_000)
    assert cli_policy.parse_budget("hbm=1024") == (Tier.HBM, 1024)
    assert cli_policy.parse_budget("hbm=none") == (Tier.HBM, None)
    assert cli_policy.parse_weight("nvme=0.3") == (Tier.NVME, 0.3)
    assert cli_policy.parse_weight("nvme=0") == (Tier.NVME, 0.0)
    for bad in ("dram=-1MiB", "dram=lots", "dram=1.5", "tape=1GiB"):
        with pytest.raises(InvalidArgument) as info:
            cli_policy.parse_budget(bad)
        assert info.value.field == "--budget", bad
    for bad in ("nvme=-0.1", "nvme=inf", "nvme=nan", "nvme=x"):
        with pytest.raises(InvalidArgument) as info:
            cli_policy.parse_weight(bad)
        assert info.value.field == "--weight", bad


def test_flags_apply_on_top_of_a_policy_later_flags_win() -> None:
    base = Policy.default()
    policy = cli_policy.apply_flags(
        base,
        watermarks=["hbm=0.7:0.6", "nvme=none", "hbm=0.75:0.5"],
        budgets=["dram=256MiB"],
        weights=["nvme=0.25"],
        eviction_policy="lru",
    )
    assert policy.watermarks == {Tier.HBM: Watermarks(0.75, 0.5), Tier.DRAM: base.watermarks[Tier.DRAM]}
    assert policy.budget_bytes_per_s == {Tier.DRAM: 256 << 20}
    assert policy.tier_weights == {**base.tier_weights, Tier.NVME: 0.25}
    assert policy.eviction_policy == "lru"
    assert base == Policy.default()  # the base is not modified
    with pytest.raises(InvalidArgument) as info:
        cli_policy.apply_flags(base, eviction_policy="Not A Name")
    assert info.value.field == "policy.eviction_policy"


def test_policy_file_yaml_and_the_json_that_policy_show_prints(tmp_path: Path) -> None:
    yaml_file = tmp_path / "policy.yaml"
    yaml_file.write_text(
        "watermarks:\n  hbm: {high: 0.9, low: 0.8}\n  dram: {high: 0.85, low: 0.7}\n"
        "tier_weights: {hbm: 1.0, dram: 0.5}\nbudget_bytes_per_s: {nvme: 64MiB, dram: 1000}\neviction_policy: value\n"
    )
    policy = cli_policy.policy_from_file(yaml_file)
    assert policy == Policy(
        watermarks={Tier.HBM: Watermarks(0.9, 0.8), Tier.DRAM: Watermarks(0.85, 0.7)},
        tier_weights={Tier.HBM: 1.0, Tier.DRAM: 0.5},
        budget_bytes_per_s={Tier.NVME: 64 << 20, Tier.DRAM: 1000},
        eviction_policy="value",
    )
    # What `kvtier policy show --json` prints reads back as the same policy.
    shown = tmp_path / "shown.json"
    shown.write_text(json.dumps(jsonable(VersionedPolicy(policy, version=7, set_by="ops", set_at_ms=1, reason="x"))))
    assert cli_policy.policy_from_file(shown) == policy


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"watermarks": {"hbm": {"high": 0.5, "low": 0.9}}}, "policy.watermarks.hbm.low"),
        ({"watermarks": {"ssd": {"high": 0.9, "low": 0.5}}}, "policy.watermarks.ssd"),
        ({"tier_weights": {"hbm": -1}}, "policy.tier_weights.hbm"),
        ({"budget_bytes_per_s": {"dram": -5}}, "policy.budget_bytes_per_s.dram"),
        ({"watermarks": {"hbm": {"high": 0.9}}}, "policy.watermarks.hbm"),
    ],
)
def test_bad_policy_files_name_the_field(tmp_path: Path, body: dict, field: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(body))
    with pytest.raises(InvalidArgument) as info:
        cli_policy.policy_from_file(path)
    assert info.value.field == field
    assert str(path) in str(info.value)


def test_policy_file_with_an_unknown_key_or_bad_syntax(tmp_path: Path, capsys) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"watermark": {}}))
    code, out, err = run(capsys, "policy", "set", "--file", str(path), "--controller", "127.0.0.1:1")
    assert_one_line_error(code, out, err, 2, "unknown key 'watermark'", str(path))
    path.write_text("{not json")
    code, out, err = run(capsys, "policy", "set", "--file", str(path), "--controller", "127.0.0.1:1")
    assert_one_line_error(code, out, err, 2, "not valid JSON")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["policy", "set", "--watermark", "ssd=0.9:0.8"], ["--watermark", "unknown tier 'ssd'"]),
        (["policy", "set", "--watermark", "hbm=0.5:0.9"], ["--watermark", "low (0.9) must be <= high (0.5)"]),
        (["policy", "set", "--budget", "tape=1GiB"], ["--budget", "unknown tier 'tape'"]),
        (["policy", "set"], ["nothing to set"]),
        (["pin", "--tier", "tape", "--tokens", "1,2"], ["--tier", "unknown tier 'tape'"]),
        (["pin", "--tier", "hbm"], ["--tokens"]),
        (["pin", "--tier", "hbm", "--tokens", "1,2,3,4", "--replicas", "17"], ["--replicas"]),
        (["evict", "--demote-to", "ssd", "--whole-namespace"], ["--demote-to", "unknown tier 'ssd'"]),
        (["evict", "--tenant", "a"], ["--whole-namespace"]),
        (["evict", "--tokens", "1", "--whole-namespace"], ["--whole-namespace"]),
        (["invalidate", "--tenant", "a", "--model", "m"], ["exactly one scope", "--tenant and --model"]),
        (["invalidate"], ["exactly one scope", "got none"]),
        (["invalidate", "--all", "--tenant", "a"], ["exactly one scope"]),
        (["invalidate", "--tenant", ""], ["--tenant must not be empty"]),
        (["sessions", "--state", "sleeping"], ["--state must be one of active, paused, resuming, ended"]),
        (["lookup", "--tokens", "1,two,3"], ["--tokens: item 1 is not a token id"]),
        (["lookup", "--tokens", "1", "--kv-dtype", "int3"], ["--kv-dtype"]),
        (["bench", "--sessions", "0,8"], ["--sessions"]),
        (["gateway", "--model", "m", "--tool-parser", "mistral"],
         ["--tool-parser", "no tool-call parser 'mistral'", "registered: hermes, llama3"]),
    ],
)
def test_bad_flags_exit_2_before_calling_the_controller(capsys, closed_port: int, args, needles) -> None:
    # The controller address is unreachable: these must fail on the flags, not on the network.
    code, out, err = run(capsys, *args, "--controller", f"127.0.0.1:{closed_port}")
    assert_one_line_error(code, out, err, 2, *needles)
    assert "cannot reach" not in err


def test_token_errors_never_echo_token_ids() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_tokens("101,102,secret103", "--tokens")
    assert "101" not in str(info.value) and "secret" not in str(info.value)


def test_token_flags_and_files(tmp_path: Path) -> None:
    assert parse_tokens("1,2, 3\n4", "--tokens") == (1, 2, 3, 4)
    assert parse_tokens("[5, 6,7]", "--tokens") == (5, 6, 7)
    listed = tmp_path / "prompt.json"
    listed.write_text(json.dumps([9, 8, 7]))
    assert tokens_from_flags(None, listed, required=True) == (9, 8, 7)
    assert tokens_from_flags(None, None, required=False) is None
    for bad in ("", "[]", "-1", "1.5"):
        with pytest.raises(InvalidArgument):
            parse_tokens(bad, "--tokens")
    with pytest.raises(InvalidArgument) as info:
        tokens_from_flags("1", listed, required=True)
    assert info.value.field == "--tokens"


# ---- namespaces from the registered workers ----------------------------------------------------


def _worker(worker_id: str, model: ModelIdentity, state: WorkerState = WorkerState.LIVE, page_size: int = 16):
    return WorkerInfo(WorkerId(worker_id), "127.0.0.1:1", BootId("b"), state, model, page_size)


def test_namespace_flags_take_model_fields_from_the_serving_workers() -> None:
    tiny = ModelIdentity("tiny", weights_digest="w1", tokenizer_digest="t1", rope_config="r", kv_dtype="fp32")
    other = ModelIdentity("other", weights_digest="w2", kv_dtype="bf16")
    ns = NamespaceFlags(tenant="acme").resolve((_worker("w0", tiny, page_size=8),))
    assert (ns.model_id, ns.weights_digest, ns.tokenizer_digest, ns.rope_config) == ("tiny", "w1", "t1", "r")
    assert (ns.kv_dtype, ns.page_size, ns.tenant, ns.adapter) == ("fp32", 8, "acme", "")

    workers = (_worker("w0", tiny), _worker("w1", other), _worker("w2", ModelIdentity("gone"), WorkerState.EXPIRED))
    with pytest.raises(CommandFailed) as info:
        NamespaceFlags().resolve(workers)
    assert info.value.exit_code == 2 and "other, tiny" in str(info.value) and "--model" in str(info.value)
    ns = NamespaceFlags(model="other", weights_digest="override").resolve(workers)
    assert (ns.model_id, ns.weights_digest, ns.kv_dtype) == ("other", "override", "bf16")
    # A model no worker serves: the flags alone name it.
    ns = NamespaceFlags(model="gone", kv_dtype="fp16", page_size=32).resolve(workers)
    assert (ns.model_id, ns.weights_digest, ns.kv_dtype, ns.page_size) == ("gone", "", "fp16", 32)
    with pytest.raises(CommandFailed) as info:
        NamespaceFlags().resolve(())
    assert info.value.exit_code == 2 and "no worker is registered" in str(info.value)


# ---- controller address, errors, JSON --------------------------------------------------------


def test_controller_address_flag_then_kvtier_up_record_then_default(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVTIER_STATE_DIR", str(tmp_path))
    assert resolve_controller(None) == "127.0.0.1:50051"
    (tmp_path / "stack.json").write_text(json.dumps({"controller": "127.0.0.1:41234", "pid": 1}))
    assert resolve_controller(None) == "127.0.0.1:41234"
    assert resolve_controller("10.0.0.5:50051") == "10.0.0.5:50051"
    (tmp_path / "stack.json").write_text("{truncated")
    assert resolve_controller(None) == "127.0.0.1:50051"


@pytest.mark.parametrize(
    ("error", "exit_code", "needles"),
    [
        (NotFound("worker 'w9' has no open WorkerLink", field="worker_id"), 1, ["NOT_FOUND from 10.0.0.5:1", "w9"]),
        (Unavailable("failed to connect\nto all addresses"), 2, ["cannot reach the controller at 10.0.0.5:1"]),
        (DeadlineExceeded("Deadline Exceeded"), 2, ["no answer from the controller at 10.0.0.5:1 within 3 s"]),
        (InvalidArgument("policy.watermarks.hbm.low (0.9) must be <= high", field="policy.watermarks.hbm.low"), 2,
         ["INVALID_ARGUMENT", "policy.watermarks.hbm.low"]),
        (PermissionDenied("role frontend may not call Admin.Drain"), 1, ["admin role"]),
        (KvtierError("UNIMPLEMENTED: Admin.Pin is not implemented"), 1, ["UNIMPLEMENTED from", "Admin.Pin"]),
    ],
)
def test_remote_errors_map_to_one_line_and_an_exit_code(error, exit_code, needles) -> None:
    failed = remote_error(Remote("10.0.0.5:1", None, 3.0), error)
    assert failed.exit_code == exit_code
    assert "\n" not in str(failed)
    for needle in needles:
        assert needle in str(failed)


def test_json_of_records_uses_tier_labels_enum_values_and_hex() -> None:
    info = SessionInfo(SessionId("s1"), SessionState.PAUSED, parked_tier=Tier.DRAM)
    occupancy = TierOccupancy(Tier.NVME, 10, 4, 3, 3, 1)
    policy = Policy(watermarks={Tier.HBM: Watermarks(0.9, 0.8)}, budget_bytes_per_s={Tier.DRAM: 5})
    doc = json.loads(json.dumps(jsonable({"s": info, "o": occupancy, "p": policy, "d": b"\x01\xff"})))
    assert doc["s"]["state"] == "paused" and doc["s"]["parked_tier"] == "dram" and doc["s"]["worker_id"] is None
    assert doc["o"] == {"tier": "nvme", "total_pages": 10, "free_pages": 4, "cached_pages": 3, "in_use_pages": 3,
                        "pinned_pages": 1, "reclaimable_pages": 0}
    assert doc["p"]["watermarks"] == {"hbm": {"high": 0.9, "low": 0.8}} and doc["p"]["budget_bytes_per_s"] == {"dram": 5}
    assert doc["d"] == "01ff"


# ---- every command: help with an example, and an unreachable controller -----------------------


@pytest.mark.parametrize("command", COMMANDS_WITH_HELP, ids=" ".join)
def test_every_command_has_help_with_an_example(capsys, command: list[str]) -> None:
    code, out, _ = run(capsys, *command, "--help")
    assert code == 0
    assert "Example" in out and f"kvtier {' '.join(command)}" in out
    assert "--json" in out and "--controller" in out and "--token" in out and "--timeout-s" in out


UNREACHABLE = [
    ["status"], ["workers"], ["tiers", "--json"], ["sessions"], ["lookup", "--tokens", "1,2"],
    ["invalidate", "--tenant", "acme"], ["drain", "worker-0", "--wait"], ["pin", "--tier", "hbm", "--tokens", "1"],
    ["unpin", "pin-1"], ["evict", "--whole-namespace"], ["snapshot"], ["bench", "--sessions", "1"],
    ["policy", "show"], ["policy", "set", "--weight", "hbm=1"], ["policy", "history"], ["policy", "rollback", "1"],
]


@pytest.mark.parametrize("command", UNREACHABLE, ids=" ".join)
def test_unreachable_controller_is_one_line_naming_it_and_exit_2(capsys, closed_port: int, command) -> None:
    address = f"127.0.0.1:{closed_port}"
    code, out, err = run(capsys, *command, "--controller", address, "--timeout-s", "5")
    assert_one_line_error(code, out, err, 2, f"cannot reach the controller at {address}", "kvtier up")


def test_controller_and_token_come_from_the_environment(capsys, closed_port: int, monkeypatch) -> None:
    address = f"127.0.0.1:{closed_port}"
    monkeypatch.setenv("KVTIER_CONTROLLER", address)
    monkeypatch.setenv("KVTIER_TOKEN", "kvt_not_a_real_token")
    code, out, err = run(capsys, "workers", "--json")
    assert_one_line_error(code, out, err, 2, address)
    assert "kvt_not_a_real_token" not in err
