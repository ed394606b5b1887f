"""The engine evicts with the code the replay measures: a trace replayed through a real
engine's index and tier manager serves exactly the hits the stand-alone replay counts."""

from __future__ import annotations

import pytest

from kvtier.cache.eviction import ExpertPolicy
from kvtier.engine import Engine
from kvtier.engine.model.config import ModelConfig
from kvtier.engine.model.llama import LlamaModel
from kvtier.tiers.manager import TierConfig
from loadtests import replay as R
from loadtests import workloads

from hf_checkpoints import COMMON


def tiny_engine(policy: str, *, hbm: int, dram: int, nvme: int) -> Engine:
    model = LlamaModel(ModelConfig.from_dict({**COMMON, "architectures": ["LlamaForCausalLM"]}))
    config = TierConfig(dram_pages=dram, nvme_slots=nvme, simulate=True, demotion_budget_bytes_per_s=None)
    return Engine(model, num_pages=hbm, page_size=1, eviction_policy=policy, tier_config=config)


@pytest.mark.parametrize("policy", ["experts", "value", "lru"])
def test_engine_cache_serves_what_replay_counts(policy):
    trace = R.trace_from_records(workloads.generate("chat", seed=1)[:400])
    hbm, dram, nvme = 24, 16, 24
    engine = tiny_engine(policy, hbm=hbm, dram=dram, nvme=nvme)
    try:
        assert engine.index.policy.name == policy
        cost = engine.index.policy.cost if policy != "lru" else None
        sim = R.Replay(policy, hbm_blocks=hbm, dram_blocks=dram, nvme_blocks=nvme, cache=(engine.index, engine.tiers),
                       cost=cost)
        through_engine = sim.run(trace, check_every=50)
        alone = R.replay(trace, policy, hbm_blocks=hbm, dram_blocks=dram, nvme_blocks=nvme, cost=cost)
        assert through_engine.hits_by_tier == alone.hits_by_tier
        assert through_engine.pages_dropped == alone.pages_dropped > 0
        assert 0.2 < alone.hit_rate < R.infinite_hit_rate(trace)
        if isinstance(engine.index.policy, ExpertPolicy):
            assert engine.index.policy.learner.history.max_keys == 4 * (hbm + dram + nvme) + 1024
    finally:
        engine.close()
