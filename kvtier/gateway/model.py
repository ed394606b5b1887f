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
from kvtier.gateway.tool_parsers import DEFAULT_PARSER, select_parser


@dataclass(slots=True)
class ServedModel:
    """What the gateway serves: the OpenAI model name, its namespace (tenant unset) and text side."""

    name: str
    namespace: NamespaceIdentity
    text: ChatText
    context_tokens: int
    tool_parser: str = DEFAULT_PARSER  # the tool-call format (kvtier.gateway.tool_parsers)


def context_tokens(checkpoint: Path) -> int:
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {checkpoint / 'config.json'}: {exc}", field="model") from exc
    return int(config.get("max_position_embeddings") or 2048)


async def describe_served_model(
    client: AsyncClient, checkpoint: Path, *, name: str | None = None, tool_parser: str | None = None
) -> ServedModel:
    """The model the registered workers serve from ``checkpoint`` (model id: its directory name);
    its tool-call format is ``tool_parser``, else the one its chat template selects."""
    model_id = checkpoint.name
    served = [m for m in await client.list_models() if m.namespace.model_id == model_id]
    if not served:
        raise Unavailable(
            f"no live worker serves model {model_id!r}; start the stack with --model {checkpoint}"
        )
    namespace = dataclasses.replace(served[0].namespace, tenant="")
    facts = served[0].facts
    context = facts.max_context_tokens if facts is not None and facts.max_context_tokens else context_tokens(checkpoint)
    text = ChatText.load(checkpoint)
    return ServedModel(name or model_id, namespace, text, context,
                       select_parser(text.tokenizer.chat_template, tool_parser))
