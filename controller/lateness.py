"""The per-tenant mix of parked tools behind each tool's prefetch aim.

The aims themselves (equal hazard, the budget the default aims spend) are pure and live in
``kvtier/policy/lateness.py``; this module keeps each tenant's last ``window`` parks in
memory and caches the aims they give until the tenant's next park.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from kvtier.policy.lateness import LatenessParams, tenant_aims
from kvtier.policy.prediction import ToolModel


class LatenessBudget:
    """Per tenant, the recent mix of parked tools and each tool's aim (``kvtier.policy.lateness``)."""

    def __init__(self, params: LatenessParams, models: Callable[[str, str], ToolModel | None]) -> None:
        self.params = params
        self._models = models
        self._mixes: collections.OrderedDict[str, collections.deque[str]] = collections.OrderedDict()
        self._aims: dict[str, dict[str, float]] = {}  # per tenant; a park of the tenant clears its entry

    def note_park(self, tenant: str, tool: str) -> None:
        """A session of ``tenant`` paused for ``tool`` was parked below HBM (a prefetch to aim)."""
        if not self.params.by_hazard:
            return
        mix = self._mixes.get(tenant)
        if mix is None:
            mix = self._mixes[tenant] = collections.deque(maxlen=self.params.window)
            while len(self._mixes) > self.params.max_tenants:
                gone, _ = self._mixes.popitem(last=False)
                self._aims.pop(gone, None)
        else:
            self._mixes.move_to_end(tenant)
        mix.append(tool)
        self._aims.pop(tenant, None)

    def aim(self, tenant: str, tool: str) -> float | None:
        """The quantile of ``tool``'s return (its ``ToolModel``) that ``tenant``'s prefetches
        for it aim at; None: aim as without a mix (the predictor's bound at ``lo_quantile``)."""
        if not self.params.by_hazard or tenant not in self._mixes:
            return None
        aims = self._aims.get(tenant)
        if aims is None:
            aims = self._aims[tenant] = self._spend(tenant)
        return aims.get(tool)

    def _spend(self, tenant: str) -> dict[str, float]:
        counts = collections.Counter(self._mixes[tenant])
        models = {t: m for t in counts if (m := self._models(tenant, t)) is not None}
        return tenant_aims(counts, models, self.params)
