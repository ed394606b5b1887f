"""The served model's description: namespace fields, tokenizer side and context length.

``describe_served_model`` is the one place the gateway learns what the workers serve. It
reads the registered workers through ``Admin.ListWorkers`` (the gateway's own token must
be an admin token when auth is on) and takes the namespace fields, page size included,
from the worker serving the model; the text side comes from the checkpoint directory the
gateway is given, the same one the workers load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvtier.client import AsyncClient
from kvtier.domain.errors import ConfigError, Unavailable
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.records import WorkerState
from kvtier.gateway.text import ChatText


@dataclass(slots=True)
class ServedModel:
    """What the gateway serves: the OpenAI model name, its namespace (tenant unset) and text side."""

    name: str
    namespace: NamespaceIdentity
    text: ChatText
    context_tokens: int


def context_tokens(checkpoint: Path) -> int:
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {checkpoint / 'config.json'}: {exc}", field="model") from exc
    return int(config.get("max_position_embeddings") or 2048)


async def describe_served_model(
    client: AsyncClient, checkpoint: Path, *, name: str | None = None
) -> ServedModel:
    """The model the registered workers serve from ``checkpoint`` (model id: its directory name)."""
    model_id = checkpoint.name
    workers = [w for w in await client.list_workers()
               if w.state is not WorkerState.EXPIRED and w.model.model_id == model_id]
    if not workers:
        raise Unavailable(
            f"no registered worker serves model {model_id!r}; start the stack with --model {checkpoint}"
        )
    w = workers[0]
    namespace = NamespaceIdentity(
        model_id=w.model.model_id,
        weights_digest=w.model.weights_digest,
        tokenizer_digest=w.model.tokenizer_digest,
        rope_config=w.model.rope_config,
        kv_dtype=w.model.kv_dtype,
        page_size=w.page_size,
    )
    return ServedModel(name or model_id, namespace, ChatText.load(checkpoint), context_tokens(checkpoint))
