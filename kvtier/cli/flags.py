"""Flags shared by the operator commands: the namespace identity (model fields default to the
served model), token ids from ``--tokens`` or a file, tiers, and the small formatters of their
tables."""


from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtier.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, CommandFailed, Remote
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import KV_DTYPES, NamespaceIdentity
from kvtier.domain.kv_dtype import is_valid_namespace_kv_dtype
from kvtier.domain.records import ModelIdentity, TierOccupancy, WorkerInfo, WorkerState
from kvtier.domain.tiers import Tier

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        show_default=False,
        help="model_id of the namespace. Default: the model the registered workers serve (when it is one).",
    ),
]
TenantOption = Annotated[str | None, typer.Option("--tenant", show_default=False, help="Tenant of the namespace.")]
AdapterOption = Annotated[str, typer.Option("--adapter", help="Adapter of the namespace; empty for none.")]
WeightsDigestOption = Annotated[
    str | None, typer.Option("--weights-digest", show_default=False, help="Default: the serving worker's.")
]
TokenizerDigestOption = Annotated[
    str | None, typer.Option("--tokenizer-digest", show_default=False, help="Default: the serving worker's.")
]
RopeConfigOption = Annotated[
    str | None, typer.Option("--rope-config", show_default=False, help="Default: the serving worker's.")
]
KvDtypeOption = Annotated[
    str | None, typer.Option("--kv-dtype", show_default=False, help="KV dtype. Default: the serving worker's.")
]
PageSizeOption = Annotated[
    int | None, typer.Option("--page-size", min=1, show_default=False, help="Default: the serving worker's.")
]
TokensOption = Annotated[
    str | None,
    typer.Option("--tokens", show_default=False, help="Prefix token ids, comma-separated: 1,2,3."),
]
TokensFileOption = Annotated[
    Path | None,
    typer.Option(
        "--tokens-file", show_default=False, help="File of prefix token ids: a JSON list, or whitespace/comma separated."
    ),
]


@dataclasses.dataclass(frozen=True, slots=True)
class NamespaceFlags:
    """The namespace identity flags as given; ``None`` means "the serving worker's value"."""

    model: str | None = None
    tenant: str | None = None
    adapter: str = ""
    weights_digest: str | None = None
    tokenizer_digest: str | None = None
    rope_config: str | None = None
    kv_dtype: str | None = None
    page_size: int | None = None

    def check(self) -> None:
        if self.kv_dtype is not None and not is_valid_namespace_kv_dtype(self.kv_dtype):
            raise InvalidArgument(
                f"--kv-dtype must be one of {', '.join(KV_DTYPES)} or an FP8 scheme such as fp8_e4m3@page-head, "
                f"got {self.kv_dtype!r}",
                field="--kv-dtype",
            )

    def resolve(self, workers: tuple[WorkerInfo, ...]) -> NamespaceIdentity:
        """Model fields from the registered workers serving ``--model`` (or the one served model),
        overridden by the flags given. Raises ``CommandFailed`` (exit 2) when the model is ambiguous."""
        serving = [w for w in workers if w.state is not WorkerState.EXPIRED]
        if self.model is not None:
            serving = [w for w in serving if w.model.model_id == self.model]
        models = {(w.model, w.page_size) for w in serving}
        if len(models) == 1:
            (model, page_size), = models
        elif self.model is not None:
            model, page_size = ModelIdentity(model_id=self.model), 16
        elif not models:
            raise CommandFailed(
                "no worker is registered, so the namespace's model is unknown; pass --model and the namespace "
                "fields (--weights-digest, --tokenizer-digest, --kv-dtype, --page-size ...)",
                EXIT_BAD_INPUT,
            )
        else:
            served = ", ".join(sorted({m.model_id for m, _ in models}))
            raise CommandFailed(f"the workers serve several models ({served}); pass --model", EXIT_BAD_INPUT)
        return NamespaceIdentity(
            model_id=model.model_id,
            weights_digest=_given(self.weights_digest, model.weights_digest),
            tokenizer_digest=_given(self.tokenizer_digest, model.tokenizer_digest),
            adapter=self.adapter,
            rope_config=_given(self.rope_config, model.rope_config),
            kv_dtype=_given(self.kv_dtype, model.kv_dtype),
            page_size=_given(self.page_size, page_size),
            tenant=self.tenant or "",
        )


def _given(flag: Any, default: Any) -> Any:
    return default if flag is None else flag


def parse_tokens(text: str, flag: str) -> tuple[int, ...]:
    """Token ids from ``1,2,3`` / whitespace / a JSON list. Errors never echo the ids."""
    body = text.strip()
    if body.startswith("["):
        body = body[1:].rstrip().removesuffix("]")
    items = [item for item in body.replace(",", " ").split() if item]
    if not items:
        raise InvalidArgument(f"{flag} holds no token ids", field=flag)
    ids = []
    for i, item in enumerate(items):
        if not item.isdigit():
            raise InvalidArgument(f"{flag}: item {i} is not a token id (a whole number >= 0)", field=flag)
        ids.append(int(item))
    return tuple(ids)


def tokens_from_flags(tokens: str | None, tokens_file: Path | None, *, required: bool) -> tuple[int, ...] | None:
    if tokens is not None and tokens_file is not None:
        raise InvalidArgument("give --tokens or --tokens-file, not both", field="--tokens")
    if tokens is not None:
        return parse_tokens(tokens, "--tokens")
    if tokens_file is not None:
        return parse_tokens(tokens_file.read_text(encoding="utf-8"), f"--tokens-file {tokens_file}")
    if required:
        raise InvalidArgument("the prefix is required: pass --tokens 1,2,3 or --tokens-file FILE", field="--tokens")
    return None


def tier_flag(name: str, flag: str) -> Tier:
    return Tier.parse(name, field=flag)


def find_worker(workers: tuple[WorkerInfo, ...], worker_id: str, remote: Remote) -> WorkerInfo:
    for w in workers:
        if w.worker_id == worker_id:
            return w
    known = ", ".join(w.worker_id for w in workers) or "none"
    raise CommandFailed(f"worker {worker_id!r} is not registered at {remote.address} (registered: {known})", EXIT_FAILED)


def format_pages(occupancies: tuple[TierOccupancy, ...], tier: Tier) -> str:
    for occ in occupancies:
        if occ.tier is tier:
            return f"{occ.cached_pages + occ.in_use_pages:,} / {occ.total_pages:,}"
    return "-"


def format_ago(ms: int) -> str:
    return f"{max(0.0, time.time() - ms / 1000):.1f} s ago" if ms else "never"


def format_at(ms: int | None) -> str:
    if ms is None:
        return "-"
    delta_s = ms / 1000 - time.time()
    return f"in {delta_s:.1f} s" if delta_s >= 0 else f"{-delta_s:.1f} s ago"
