"""The served model's description: namespace fields, tokenizer side and context length.

``describe_served_model`` is the one place the gateway learns what the workers serve. It
asks ``Router.ListModels`` (a frontend token is enough) for the exact namespace fields,
page size included, of the model served from the gateway's checkpoint directory; the text
side comes from that directory, the same one the workers load. The tenant field is left
empty: each request's tenant comes from its own key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from kvtier.client import AsyncClient
from kvtier.domain.errors import ConfigError, Unavailable
from kvtier.domain.hashing import NamespaceIdentity
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
    served = [m for m in await client.list_models() if m.namespace.model_id == model_id]
    if not served:
        raise Unavailable(
            f"no live worker serves model {model_id!r}; start the stack with --model {checkpoint}"
        )
    namespace = dataclasses.replace(served[0].namespace, tenant="")
    facts = served[0].facts
    context = facts.max_context_tokens if facts is not None and facts.max_context_tokens else context_tokens(checkpoint)
    return ServedModel(name or model_id, namespace, ChatText.load(checkpoint), context)
