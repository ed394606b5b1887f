"""The paged engine: sequences, scheduler, model runner, sampler, and the Engine API.

Exports load lazily so that ``kvtier.domain.params`` (used by the wire layer and the
CLI) does not pull in the model and torch kernels.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Engine": "kvtier.engine.engine",
    "GenerationResult": "kvtier.engine.engine",
    "StepOutput": "kvtier.engine.engine",
    "FinishReason": "kvtier.domain.params",
    "SamplingParams": "kvtier.domain.params",
    "SchedulerConfig": "kvtier.engine.scheduler",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module), name)
