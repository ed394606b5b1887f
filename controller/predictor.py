"""The tool-return predictor's store: per-(tenant, tool) duration histories in Redis.

The model (decayed log-histogram, quantiles, lognormal prediction bounds) is pure and lives
in ``kvtier/policy/prediction.py``; this module keeps the histories and writes them through.

Persistence: a Redis hash per (tenant, tool) under ``kvt:tool:<blake2b(tenant, tool)>``
(fields ``tenant``, ``tool``, ``n`` and ``b<bin>``), written through on every
observation and loaded by ``load()`` at start, so a controller restart (or a standby
taking over) keeps the history. Bounded: tool names come from callers, so a tenant keeps at
most ``max_tools_per_tenant`` histories (learning a new tool past that forgets the tenant's
least recently observed one, in memory and in Redis), and a history not observed for
``history_ttl_s`` expires from Redis.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable
from typing import cast

from redis.typing import EncodableT, FieldT

from kvtier.controller.redis_connect import RedisClient
from kvtier.domain.errors import InvalidArgument
from kvtier.policy.prediction import (
    Prediction,
    PredictorParams,
    ToolHistory,
    ToolModel,
    is_trusted,
    predict,
    return_spread,
    tool_model,
)
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.predictor")

KEY_PREFIX = "kvt:tool:"


def history_key(tenant: str, tool: str) -> str:
    digest = hashlib.blake2b(f"{len(tenant)}:{tenant}\0{tool}".encode(), digest_size=12).hexdigest()
    return KEY_PREFIX + digest


class ToolReturnPredictor:
    """Per-(tenant, tool) predictions of tool durations, persisted in Redis."""

    def __init__(
        self, client: RedisClient, params: PredictorParams | None = None,
        *, on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.client = client
        self.params = params or PredictorParams()
        self._on_error = on_error
        self._histories: dict[tuple[str, str], ToolHistory] = {}
        # Per tenant, its tools from least to most recently observed (``max_tools_per_tenant``).
        self._recency: dict[str, collections.OrderedDict[str, None]] = {}

    def history(self, tenant: str, tool: str) -> ToolHistory | None:
        return self._histories.get((tenant, tool))

    async def load(self) -> int:
        """Read every stored history (start-up, leadership gained); returns how many."""
        loaded = 0
        async for key in self.client.scan_iter(match=KEY_PREFIX + "*", count=500):
            # The client leaves decode_responses off, so redis replies are bytes.
            raw = cast("dict[bytes, bytes]", await self.client.hgetall(key))
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            if "tenant" not in fields or "tool" not in fields:
                continue
            history = ToolHistory(fields["tenant"], fields["tool"], self.params.half_life_obs,
                                  num_observations=int(fields.get("n", "0")))
            history.bins = {int(k[1:]): float(v) for k, v in fields.items() if k.startswith("b")}
            self._histories[(history.tenant, history.tool)] = history
            self._recency.setdefault(history.tenant, collections.OrderedDict())[history.tool] = None
            loaded += 1
        log.info("tool histories loaded", extra={"num_histories": loaded})
        return loaded

    async def observe(self, tenant: str, tool: str, duration_ms: float) -> None:
        """Record one measured tool duration and write it through to Redis."""
        if not duration_ms >= 0:
            raise InvalidArgument(f"a tool duration must be >= 0 ms, got {duration_ms}", field="duration_ms")
        recency = self._recency.setdefault(tenant, collections.OrderedDict())
        forgotten: list[str] = []
        history = self._histories.get((tenant, tool))
        if history is None:
            while len(recency) >= self.params.max_tools_per_tenant:
                old, _ = recency.popitem(last=False)
                del self._histories[(tenant, old)]
                forgotten.append(history_key(tenant, old))
            if forgotten:
                log.info("tool histories forgotten: the tenant keeps at most max_tools_per_tenant", extra={
                    "tenant": tenant, "num_forgotten": len(forgotten),
                    "max_tools_per_tenant": self.params.max_tools_per_tenant})
            history = self._histories[(tenant, tool)] = ToolHistory(tenant, tool, self.params.half_life_obs)
        recency[tool] = None
        recency.move_to_end(tool)
        b, weight, rescaled = history.observe(duration_ms)
        key = history_key(tenant, tool)
        mapping: dict[FieldT, EncodableT] = {"tenant": tenant, "tool": tool, "n": history.num_observations}
        try:
            if forgotten:
                # Outside the transaction: histories hash to different slots, and on Redis
                # Cluster the client splits this DEL by slot. A failure in between is like a
                # failed write (below): the in-memory history still serves.
                await self.client.delete(*forgotten)
            async with self.client.pipeline(transaction=True) as pipe:  # one key: one slot
                if rescaled:
                    pipe.delete(key)
                    mapping.update({f"b{k}": repr(v) for k, v in history.bins.items()})
                else:
                    mapping[f"b{b}"] = repr(weight)
                pipe.hset(key, mapping=mapping)
                pipe.pexpire(key, max(1, round(self.params.history_ttl_s * 1000)))
                await pipe.execute()
        except Exception as exc:  # the in-memory history still serves; Redis catches up next time
            if self._on_error is None:
                raise
            self._on_error(exc)

    def predict(
        self, tenant: str, tool: str | None, expected_ms: float | None = None, *, aim: float | None = None
    ) -> Prediction:
        """The next return of ``tenant``'s ``tool`` (``kvtier.policy.prediction.predict``)."""
        return predict(self._histories.get((tenant, tool or "")), self.params, expected_ms, aim=aim)

    def model(self, tenant: str, tool: str, min_samples: float = 0.0) -> ToolModel | None:
        """``ToolModel`` of a history worth ``min_samples`` returns (and the params'), else None."""
        history = self._histories.get((tenant, tool))
        if history is None or not is_trusted(history, self.params, min_samples):
            return None
        return tool_model(history, self.params)

    def spread(self, prediction: Prediction) -> float | None:
        """``kvtier.policy.prediction.return_spread`` at this predictor's ``hi_quantile``."""
        return return_spread(prediction, self.params.hi_quantile)
