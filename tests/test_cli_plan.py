"""``kvtier plan`` and ``kvtier demo``: output, JSON shape, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli.main import main

REPO = Path(__file__).parents[1]
EXAMPLE = REPO / "kvtier" / "examples" / "llama-3.1-8b.json"
AZURE_TRACE = REPO.parent / "shared" / "traces" / "azure_llm_inference_2023_code.csv"
GIB = 1 << 30

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "vocab_size": 129280,
}


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``kvtier ARGS`` in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, err = run(capsys, "plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def write_config(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_plan_json_for_llama_31_8b(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        *("--model-config", str(EXAMPLE), "--hbm-gib", "80", "--dram-gib", "256", "--nvme-gib", "2000"),
        *("--context", "8192", "--context", "32768"),
    )
    assert out["bytes_per_token"] == 131_072
    assert out["bytes_per_page"] == 2 * 1024 * 1024
    assert out["latent"] is False and out["note"] is None
    assert out["weights_bytes"] == out["model"]["param_count"] * 2
    assert set(out["pages"]) == {"hbm", "dram", "nvme"}
    assert out["pages"]["dram"] == 256 * GIB // (2 * 1024 * 1024)
    assert out["sessions"]["dram"] == {"8192": 256, "32768": 64}
    assert out["sessions"]["hbm"]["32768"] == out["pages"]["hbm"] // 2048
    assert out["kv_budget_bytes"]["nvme"] == 2000 * GIB
    assert "page_size_study" not in out


def test_plan_json_fp8_and_page_size(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--model-config", str(EXAMPLE), "--kv-dtype", "fp8", "--page-size", "32")
    # fp8 pages carry one fp32 scale per (layer, plane, kv head): 32 x 2 x 8 x 4 bytes.
    assert out["bytes_per_token"] == 65_536 and out["bytes_per_page"] == 32 * 65_536 + 2048
    assert out["kv_dtype"] == "fp8" and out["sessions"]["hbm"].keys() == {"4096", "32768"}
    mixed = run_json(capsys, "--model-config", str(EXAMPLE), "--kv-dtype", "bf16/fp8", "--dram-gib", "1")
    assert mixed["bytes_per_page"] == 16 * 131_072 and mixed["lower_bytes_per_page"] == 16 * 65_536 + 2048
    assert mixed["pages"]["dram"] == GIB // (16 * 65_536 + 2048)


def test_plan_json_latent_cache(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = write_config(tmp_path, DEEPSEEK_V3)
    out = run_json(capsys, "--model-config", str(config), "--hbm-gib", "2000", "--weights-dtype", "fp8")
    assert out["bytes_per_token"] == 70_272
    assert out["latent"] is True and "latent" in out["note"]
    assert out["model"]["attention"] == "MLA"
    assert out["weights_bytes"] == out["model"]["param_count"]


def test_plan_json_checkpoint_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(EXAMPLE.read_text())
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    out = run_json(capsys, "--model-config", str(tmp_path))
    assert (out["weights_source"], out["weights_bytes"]) == ("safetensors", 8)


def test_plan_json_with_page_size_study(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("id,tokens\na,1\nb,15\nc,16\nd,17\ne,100\n")
    out = run_json(
        capsys,
        *("--model-config", str(EXAMPLE), "--lengths-csv", str(lengths), "--column", "tokens"),
        *("--budget-tokens", "20"),
    )
    study = out["page_size_study"]
    assert study["num_requests"] == 5 and study["budget_tokens"] == 20
    row16 = next(r for r in study["rows"] if r["page_size"] == 16)
    assert row16["page_table_entries"] == 12
    assert row16["fragmentation_pct"] == pytest.approx(100 * 43 / 192)
    assert row16["fit_budget_pct"] == 60.0


def test_plan_tables(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "plan", "--model-config", str(EXAMPLE), "--dram-gib", "256", "--context", "8192"
    )
    assert code == 0, err
    assert "128.00 KiB per token" in out and "2.00 MiB" in out
    for text in ("HBM", "DRAM", "NVMe", "sessions @ 8,192", "131,072"):
        assert text in out


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"num_hidden_layers": None}, ("config.json is missing 'num_hidden_layers'",)),
        (
            {"architectures": ["RwkvForCausalLM"], "model_type": "rwkv"},
            ("RwkvForCausalLM", "Llama", "DeepSeek"),
        ),
    ],
)
def test_bad_model_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, changes: dict[str, Any], needles: tuple[str, ...]
) -> None:
    config = json.loads(EXAMPLE.read_text())
    config.update(changes)
    code, _, err = run(capsys, "plan", "--model-config", str(write_config(tmp_path, config)))
    assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--hbm-gib", "0"), ("--hbm-gib must be > 0, got 0.0",)),
        (("--hbm-gib", "-1"), ("--hbm-gib must be > 0",)),
        (("--dram-gib", "-1"), ("--dram-gib must be >= 0, got -1.0",)),
        (("--nvme-gib", "inf"), ("--nvme-gib must be a finite number",)),
        (("--page-size", "12"), ("--page-size must be a power of two in [1, 1024], got 12",)),
        (("--page-size", "2048"), ("--page-size must be a power of two",)),
        (("--headroom", "1"), ("--headroom must be in [0, 1), got 1.0",)),
        (("--kv-dtype", "int8"), ("--kv-dtype 'int8' is not one of",)),
        (("--weights-dtype", "int3"), ("--weights-dtype 'int3'",)),
        (("--context", "0"), ("--context must be >= 1",)),
        (("--lengths-csv", "x.csv"), ("--lengths-csv and --column go together",)),
    ],
)
def test_bad_flags(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    code, _, err = run(capsys, "plan", "--model-config", str(EXAMPLE), *args)
    assert_one_line_error(code, err, *needles)


def test_missing_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "plan", "--model-config", str(tmp_path / "absent.json"))
    assert_one_line_error(code, err, "absent.json does not exist")
    code, _, err = run(capsys, "plan", "--model-config", str(tmp_path))
    assert_one_line_error(code, err, "has no config.json")
    args = ("--lengths-csv", str(tmp_path / "absent.csv"), "--column", "n")
    code, _, err = run(capsys, "plan", "--model-config", str(EXAMPLE), *args)
    assert_one_line_error(code, err, "cannot read lengths CSV")


def test_bad_csv_column_lists_available(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("TIMESTAMP,ContextTokens\nt,5\n")
    args = ("--lengths-csv", str(lengths), "--column", "Prompt")
    code, _, err = run(capsys, "plan", "--model-config", str(EXAMPLE), *args)
    assert_one_line_error(code, err, "column 'Prompt'", "available columns: TIMESTAMP, ContextTokens")


def test_planner_demo(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "demo", "--planner", "--quick")
    assert code == 0, err
    assert "Llama" in out and "sessions @ 32,768" in out
    assert ("fragmentation" in out) == AZURE_TRACE.is_file()  # the study's table
    if not AZURE_TRACE.is_file():
        assert "skipping the page-size study" in out


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0 and "Examples" in out and "--model-config" in out


def kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_entry_point_error_has_no_traceback(tmp_path: Path) -> None:
    config = json.loads(EXAMPLE.read_text())
    del config["num_hidden_layers"]
    result = kvtier("plan", "--model-config", str(write_config(tmp_path, config)), "--json")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and "num_hidden_layers" in result.stderr
    assert "Traceback" not in result.stderr


def test_entry_point_success() -> None:
    result = kvtier("plan", "--model-config", str(EXAMPLE), "--json", "--context", "8192")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["sessions"]["hbm"]["8192"] > 0
