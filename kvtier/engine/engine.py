"""The offline and step-level engine API that the worker drives.

    engine = Engine.from_pretrained(path, page_size=16, num_pages=512)
    results = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))

or, step by step (what the worker's engine loop does)::

    rid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        for out in engine.step(): ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtier.cache.eviction import DEFAULT_POLICY, CostModel, make_engine_policy, reorder
from kvtier.cache.page_pool import PagePool, PoolGeometry
from kvtier.cache.quotas import QuotaTable, QuotaTracker
from kvtier.cache.radix import EvictionPolicy, RadixIndex, RadixNode
from kvtier.cache.ttls import TtlSweeper, TtlTable
from kvtier.domain.errors import IntegrityError, InvalidArgument, NotFound, ResourceExhausted
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity, PageKey, namespace_digest
from kvtier.domain.kv_dtype import KvCacheDtype, KvElement, resolve
from kvtier.domain.params import FinishReason, SamplingParams
from kvtier.domain.tiers import Tier
from kvtier.engine.attention.fp8 import Fp8PageCodec
from kvtier.engine.attention.registry import get_backend
from kvtier.engine.model import LlamaModel, load_model
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampler import make_generator, sample
from kvtier.engine.scheduler import ReleasePin, Scheduler, SchedulerConfig
from kvtier.engine.sequence import Sequence, SequenceStatus
from kvtier.policy.admission import AdmissionPages
from kvtier.tiers.manager import TierConfig, TierManager

log = logging.getLogger("kvtier.engine")

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Pages quota enforcement and TTL expiry may handle per step (each), so a burst of work never
# stalls decode for long; what is left goes in the next steps (or the worker's idle loop).
LIMIT_PAGES_PER_STEP = 64
# Namespaces an engine keeps state for (``digest_for``), per tenant and in all. Every distinct
# value of a field a caller may choose (its tokenizer digest; its tenant without authentication)
# is a namespace, so without a bound a client varying one per request grows the worker's
# memory without end. Far above what serving needs (tenants x tokenizers); an invalidated
# namespace frees its place once its pages are reclaimed (``forget_namespace``).
MAX_NAMESPACES_PER_TENANT = 1024
MAX_NAMESPACES = 65_536


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request: new tokens, and the end if it ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    num_cached_tokens: int
    num_computed_tokens: int
    num_preemptions: int
    num_promoted_tokens: int = 0
    promoted_tokens_by_tier: dict[Tier, int] = field(default_factory=dict)
    promotion_wait_s: float = 0.0
    prefill_started_at: float | None = None  # perf_counter() when its first forward pass began (spans)
    logits: list[torch.Tensor] | None = field(default=None, repr=False)


def weights_digest(path: Path) -> str:
    """BLAKE2b of the checkpoint's config and tensor files (weights change → new namespace)."""
    h = hashlib.blake2b(digest_size=16)
    for file in sorted(path.glob("*.safetensors")) + [path / "config.json"]:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def default_namespace(
    path: Path, model: LlamaModel, *, page_size: int, kv_dtype: str, model_id: str | None = None
) -> NamespaceIdentity:
    """The identity an engine serving this checkpoint derives its page keys from."""
    return NamespaceIdentity(
        model_id=model_id or path.name,
        weights_digest=weights_digest(path),
        rope_config=json.dumps(model.config.rope_scaling or {}, sort_keys=True),
        kv_dtype=kv_dtype,
        page_size=page_size,
    )


def cache_format(model_dtype: torch.dtype, kv_cache_dtype: str | None) -> KvCacheDtype:
    """The engine's cache format: ``kv_cache_dtype`` resolved (``kvtier.domain.kv_dtype``), or,
    when None, pages in the model's own float dtype."""
    if kv_cache_dtype is None:
        element = KvElement(_DTYPE_NAMES.get(model_dtype, "fp32"))
        return KvCacheDtype(element, element)
    return resolve(kv_cache_dtype)


def page_dtype(model_dtype: torch.dtype, element: KvElement) -> torch.dtype:
    """The pool geometry's dtype for one tier's element: the model's dtype for a float cache
    (the model computes K/V in it), an FP8 torch dtype for FP8 pages."""
    if element.is_fp8:
        return _FP8_DTYPES[element.fp8_format]
    if _DTYPE_NAMES.get(model_dtype) != element.base:
        raise InvalidArgument(
            f"kv_cache_dtype {element.name} needs a model loaded in {element.name}, got {model_dtype}; "
            "load the model in the KV dtype or choose an fp8 cache",
            field="kv_cache_dtype",
        )
    return model_dtype


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        *,
        num_pages: int,
        page_size: int = 16,
        namespace: NamespaceIdentity | None = None,
        attention_backend: str = "auto",
        scheduler_config: SchedulerConfig | None = None,
        eviction_policy: EvictionPolicy | str | None = None,
        max_model_len: int | None = None,
        record_logits: bool = False,
        tier_config: TierConfig | None = None,
        tenant_quotas: QuotaTable | None = None,
        namespace_ttls: TtlTable | None = None,
        kv_cache_dtype: str | None = None,
    ) -> None:
        if page_size < 1:
            raise InvalidArgument(f"page_size must be >= 1, got {page_size}", field="page_size")
        self.model = model
        cfg = model.config
        param = next(model.parameters())
        num_layers, kv_heads, head_dim = model.kv_geometry
        self.cache_format = cache_format(param.dtype, kv_cache_dtype)
        hbm_dtype = page_dtype(param.dtype, self.cache_format.hbm)
        self.geometry = PoolGeometry(num_layers, kv_heads, head_dim, page_size, hbm_dtype)
        self.pool = PagePool(num_pages, self.geometry, device=param.device)
        if namespace is not None and kv_cache_dtype is not None and namespace.kv_dtype != self.cache_format.name:
            raise InvalidArgument(
                f"namespace.kv_dtype is {namespace.kv_dtype!r} but this engine's cache is {self.cache_format.name!r}",
                field="namespace.kv_dtype",
            )
        if eviction_policy is None or isinstance(eviction_policy, str):
            # A policy by name (kvtier.cache.eviction.POLICY_NAMES) gets this engine's cost model and
            # tiers. Value-based eviction is the default (LRU stays selectable): the trace replay
            # shows it at or above LRU at every capacity (loadtests/replay.py).
            tiers = [Tier.HBM]
            capacity_pages = num_pages
            if tier_config is not None:
                tiers += [Tier.DRAM] if tier_config.dram_pages else []
                tiers += [Tier.NVME] if tier_config.nvme_slots else []
                capacity_pages += tier_config.dram_pages + tier_config.nvme_slots
            eviction_policy = make_engine_policy(
                eviction_policy or DEFAULT_POLICY,
                cost=self._cost_model(model, self.geometry),
                tiers=tiers,
                capacity_pages=capacity_pages,
            )
        self.index = RadixIndex(self.pool, eviction_policy)
        if tier_config is not None and self.cache_format.requantizes_below:
            lower = self.cache_format.lower
            tier_config = dataclasses.replace(tier_config, lower_codec=Fp8PageCodec(self.geometry, lower.fp8_format))
        self.tiers = TierManager(self.index, tier_config) if tier_config is not None else None
        self.backend = get_backend(attention_backend, param.device)
        self.runner = ModelRunner(model, self.pool, self.backend)
        self.vocab_size = cfg.vocab_size
        self.max_model_len = min(max_model_len or cfg.max_context_len, cfg.max_context_len)
        self.eos_token_ids: frozenset[int] = frozenset(cfg.eos_token_ids)
        self.namespace = namespace or NamespaceIdentity(
            model_id="unnamed", kv_dtype=self.cache_format.name, page_size=page_size
        )
        self._digests: dict[NamespaceIdentity, NamespaceDigest] = {}
        self._identities: dict[NamespaceDigest, NamespaceIdentity] = {}  # the reverse, for quotas and TTLs
        self._num_namespaces: dict[str, int] = {}  # per tenant
        self.quotas = QuotaTracker(
            self.index, tenant_quotas, page_bytes=self.geometry.page_bytes, identity_of=self._identities.get,
            tiers=self.tiers,
        ) if tenant_quotas else None
        self.scheduler = Scheduler(self.pool, self.index, scheduler_config, self.tiers, self.quotas)
        self.ttls = TtlSweeper(self.index, namespace_ttls, identity_of=self._identities.get) if namespace_ttls else None
        self.record_logits = record_logits
        self._seqs: dict[str, Sequence] = {}
        self._prefill_started_at: dict[str, float] = {}  # request id -> first forward pass (tracing)
        self._arrival = itertools.count()
        self._request_ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        hbm_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        model_id: str | None = None,
        kv_cache_dtype: str | None = None,
        **kwargs,
    ) -> Engine:
        path = Path(path)
        model = load_model(path, dtype=dtype, device=device)
        num_layers, kv_heads, head_dim = model.kv_geometry
        kv_format = cache_format(dtype, kv_cache_dtype)
        geometry = PoolGeometry(num_layers, kv_heads, head_dim, page_size, page_dtype(dtype, kv_format.hbm))
        if num_pages is None:
            if hbm_bytes is None:
                raise InvalidArgument("give num_pages or hbm_bytes to size the page pool", field="num_pages")
            num_pages = geometry.pages_for_bytes(hbm_bytes)
            if num_pages < 1:
                raise InvalidArgument(
                    f"hbm_bytes={hbm_bytes} holds no page of {geometry.page_bytes} bytes", field="hbm_bytes"
                )
        namespace = kwargs.pop("namespace", None) or default_namespace(
            path, model, page_size=page_size, kv_dtype=kv_format.name, model_id=model_id
        )
        return cls(
            model, num_pages=num_pages, page_size=page_size, namespace=namespace, kv_cache_dtype=kv_cache_dtype,
            **kwargs,
        )

    @staticmethod
    def _cost_model(model: LlamaModel, geometry: PoolGeometry) -> CostModel:
        cfg = model.config
        num_params = sum(p.numel() for p in model.parameters())
        return CostModel(
            num_params=float(num_params),
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.num_attention_heads * cfg.head_dim,
            page_size=geometry.page_size,
            page_bytes=geometry.page_bytes,
        )

    # ---- requests -------------------------------------------------------------------
    def digest_for(self, namespace: NamespaceIdentity | None) -> NamespaceDigest:
        ns = namespace or self.namespace
        digest = self._digests.get(ns)
        if digest is None:
            ns.validate()
            num = self._num_namespaces.get(ns.tenant, 0)
            if num >= MAX_NAMESPACES_PER_TENANT or len(self._digests) >= MAX_NAMESPACES:
                raise ResourceExhausted(
                    f"this worker already keeps {num} namespaces of tenant {ns.tenant!r} "
                    f"({len(self._digests)} in all; at most {MAX_NAMESPACES_PER_TENANT} per tenant, "
                    f"{MAX_NAMESPACES} in all): every distinct namespace.tokenizer_digest is one, so keep it "
                    "the same for requests that share a tokenizer",
                    field="namespace",
                )
            digest = self._digests[ns] = namespace_digest(ns)
            self._identities[digest] = ns
            self._num_namespaces[ns.tenant] = num + 1
            for limits in (self.quotas, self.ttls):
                if limits is not None:
                    limits.learn(digest)
        return digest

    def forget_namespace(self, digest: NamespaceDigest) -> None:
        """Drop what the engine keeps for ``digest`` (an invalidated namespace whose pages and
        sequences are gone): its place under ``MAX_NAMESPACES_PER_TENANT`` frees up."""
        identity = self._identities.pop(digest, None)
        if identity is None:
            return
        self._digests.pop(identity, None)
        for limits in (self.quotas, self.ttls):
            if limits is not None:
                limits.forget(digest)
        num = self._num_namespaces.get(identity.tenant, 0) - 1
        if num > 0:
            self._num_namespaces[identity.tenant] = num
        else:
            self._num_namespaces.pop(identity.tenant, None)

    def check_prompt(self, prompt: Collection[int]) -> None:
        """Raise ``InvalidArgument`` unless ``prompt`` is a prompt this model can continue: token
        ids in its vocabulary, and room left in its context. Reads only the model's shape, so
        any thread may call it."""
        if not prompt:
            raise InvalidArgument("prompt_token_ids must not be empty", field="prompt_token_ids")
        for i, tok in enumerate(prompt):
            if not (0 <= tok < self.vocab_size):
                raise InvalidArgument(
                    f"prompt token id {tok} at index {i} is outside the vocabulary [0, {self.vocab_size})",
                    field="prompt_token_ids",
                )
        if len(prompt) >= self.max_model_len:
            raise InvalidArgument(
                f"prompt of {len(prompt)} tokens leaves no room to generate: "
                f"the model context is {self.max_model_len} tokens",
                field="prompt_token_ids",
            )

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        namespace: NamespaceIdentity | None = None,
    ) -> str:
        """Validate a request (its sampling parameters and its prompt) and queue it."""
        params = params or SamplingParams()
        params.validate()
        self.check_prompt(prompt)
        return self.enqueue(prompt, params, request_id=request_id, priority=priority, namespace=namespace)

    def enqueue(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        namespace: NamespaceIdentity | None = None,
    ) -> str:
        """Queue a request validated at the caller's edge (``SamplingParams.validate`` and
        ``check_prompt``), as a worker does when the request arrives; ``add_request`` validates."""
        rid = request_id or f"req-{next(self._request_ids)}"
        if rid in self._seqs:
            raise InvalidArgument(f"request id {rid!r} is already in flight", field="request_id")
        seq = Sequence(
            request_id=rid,
            prompt_len=len(prompt),
            tokens=list(prompt),
            params=params,
            namespace=self.digest_for(namespace),
            page_size=self.pool.page_size,
            arrival=next(self._arrival),
            priority=priority,
            generator=make_generator(params),
            logits_trace=[] if self.record_logits else None,
        )
        self.scheduler.add(seq)
        self._seqs[rid] = seq
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request and release its pages; False if it already finished."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        seq.finish_reason = FinishReason.ABORTED
        self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- what a caller driving the engine may read ------------------------------------
    @property
    def num_queued(self) -> int:
        """Requests added and not yet admitted (or preempted back into the queue)."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def request_ids(self) -> set[str]:
        """Requests the scheduler holds, queued or running."""
        return {seq.request_id for seq in (*self.scheduler.waiting, *self.scheduler.running)}

    def busy_namespaces(self) -> set[NamespaceDigest]:
        """Namespaces of the requests the scheduler holds, queued or running."""
        return {seq.namespace for seq in (*self.scheduler.waiting, *self.scheduler.running)}

    def queued_demand(self) -> list[AdmissionPages]:
        """The pages each queued request's admission takes, in queue order, its cached prefix
        as the index holds it now (``admission_pages``)."""
        return [self.admission_pages(seq.num_tokens, seq.params.max_tokens - seq.num_output,
                                     self.cached_chain(seq.full_page_keys()))
                for seq in self.scheduler.waiting]

    def admission_pages(self, num_tokens: int, num_output_left: int, chain: Iterable[RadixNode]) -> AdmissionPages:
        """The pages admitting a request of ``num_tokens`` tokens (``num_output_left`` still to
        generate) takes, ``chain`` its cached prefix, root first (``Scheduler.admission_pages``)."""
        tiers = [n.tier for n in chain]
        num_hbm = next((i for i, t in enumerate(tiers) if t is not Tier.HBM), len(tiers))
        return self.scheduler.admission_pages(num_tokens, num_output_left, num_hbm, len(tiers) - num_hbm)

    def cached_chain(self, keys: Iterable[PageKey]) -> list[RadixNode]:
        """Cached nodes of the longest cached prefix of ``keys`` (root first)."""
        chain: list[RadixNode] = []
        for key in keys:
            node = self.index.get(key)
            if node is None:
                break
            chain.append(node)
        return chain

    def get(self, request_id: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise NotFound(f"no request {request_id!r}", field="request_id")
        return seq

    def pop_result(self, request_id: str) -> GenerationResult:
        """The finished request's result; the engine forgets it afterwards."""
        seq = self.get(request_id)
        if not seq.is_finished:
            raise InvalidArgument(f"request {request_id!r} has not finished", field="request_id")
        del self._seqs[request_id]
        prefill_started_at = self._prefill_started_at.pop(request_id, None)
        assert seq.finish_reason is not None
        return GenerationResult(
            request_id=seq.request_id,
            prompt_token_ids=seq.tokens[: seq.prompt_len],
            token_ids=seq.output,
            finish_reason=seq.finish_reason,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_computed_tokens=seq.num_computed_tokens,
            num_preemptions=seq.num_preemptions,
            num_promoted_tokens=seq.num_promoted_tokens,
            promoted_tokens_by_tier=dict(seq.promoted_tokens_by_tier),
            promotion_wait_s=seq.promotion_wait_s,
            prefill_started_at=prefill_started_at,
            logits=seq.logits_trace,
        )

    # ---- stepping -------------------------------------------------------------------
    def step(self, *, release_pin: ReleasePin | None = None) -> list[StepOutput]:
        """One batch: prefills admitted now, or one decode token per running sequence.
        ``release_pin`` lets a pin that may yield go (True) before a sequence is preempted or an
        admission waits (a worker's session holds: ``Scheduler.schedule``)."""
        self.index.expire_pins()
        reorder(self.index)
        if self.tiers is not None:
            self.tiers.maintain()
        self.enforce_limits()
        batch = self.scheduler.schedule(release_pin)
        if batch is None:
            return []
        outputs: list[StepOutput] = []
        for seq in batch.capped:
            seq.finish_reason = FinishReason.LENGTH
            self.scheduler.finish(seq)
            outputs.append(StepOutput(seq.request_id, [], True, FinishReason.LENGTH))
        if not batch.seqs:
            return outputs
        forward_at = time.perf_counter()
        logits = self.runner.run(batch.seqs)
        for seq, row in zip(batch.seqs, logits, strict=True):
            if seq.num_computed_tokens == 0:  # its first forward pass: prefill began at forward_at
                self._prefill_started_at[seq.request_id] = forward_at
            seq.num_computed_tokens += seq.num_tokens - seq.num_computed
            seq.num_computed = seq.num_tokens
            self.scheduler.register_full_pages(seq)
            if seq.logits_trace is not None:
                seq.logits_trace.append(row.detach().float().cpu().clone())
            token = sample(row, seq.params, seq.generator)
            seq.tokens.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
            outputs.append(StepOutput(seq.request_id, [token], reason is not None, reason))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        tail = seq.tokens[seq.prompt_len :]
        if p.tool_call_sequence and tail[-len(p.tool_call_sequence) :] == p.tool_call_sequence:
            return FinishReason.TOOL_CALL
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        for stop in p.stop_sequences:
            if tail[-len(stop) :] == stop:
                return FinishReason.STOP
        if seq.num_output >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        namespace: NamespaceIdentity | None = None,
    ) -> list[GenerationResult]:
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidArgument(f"{len(prompts)} prompts but {len(params)} sampling params", field="params")
        rids = [self.add_request(p, sp, namespace=namespace) for p, sp in zip(prompts, params, strict=True)]
        while any(not self._seqs[r].is_finished for r in rids):
            self.step()
        self.enforce_limits()  # the last step cached pages after its own enforcement ran
        return [self.pop_result(r) for r in rids]

    # ---- quotas and TTLs ------------------------------------------------------------
    def enforce_limits(self, max_pages: int = LIMIT_PAGES_PER_STEP) -> int:
        """Drop pages whose namespace TTL passed, then bring tenants over a quota back
        under it (``kvtier.cache.ttls``, ``kvtier.cache.quotas``); at most ``max_pages`` pages each.
        Returns the pages handled."""
        done = 0
        if self.ttls is not None:
            done += self.ttls.expire(max_pages=max_pages)
        if self.quotas is not None:
            done += self.quotas.enforce(max_pages)
        return done

    def limits_wait_s(self) -> float | None:
        """Seconds until ``enforce_limits`` has work (0: now; None: nothing scheduled), for an idle caller."""
        if self.quotas is not None and self.quotas.has_work():
            return 0.0
        deadline = self.ttls.next_deadline() if self.ttls is not None else None
        return None if deadline is None else max(0.0, deadline - self.index.clock())

    def check_integrity(self) -> None:
        """Raise with the numbers if any pool, index or sequence accounting is off."""
        self.scheduler.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        if self.quotas is not None:
            self.quotas.check_integrity()
        for seq in self._seqs.values():
            if seq.status is SequenceStatus.FINISHED and seq.pages:
                raise IntegrityError(f"finished {seq.request_id} still holds pages")

    def close(self) -> None:
        """Stop the transfer threads and close the NVMe files (pages on disk stay recoverable)."""
        if self.tiers is not None:
            self.tiers.close()
