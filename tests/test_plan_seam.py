"""Batch plans are self-contained: plans the scheduler builds, replayed on a
second engine instance (as a tensor-parallel follower would), give the very
same tokens, placeholders (overlap) included."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

import torch

from aioserve.config import EngineConfig
from aioserve.engine.engine import Engine
from aioserve.engine.executor import ThreadExecutor
from aioserve.sampling_params import SamplingParams
from aioserve.scheduler import Request, Scheduler
from aioserve.scheduler.factory import model_facts


class MirroringExecutor(ThreadExecutor):
    """Runs every plan on the scheduler's engine and, after a pickle round
    trip (plain data only), on a second engine; records both outputs."""

    def __init__(self, engine: Engine, follower: Engine) -> None:
        super().__init__(engine)
        self.follower = follower
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _both(self, plan):
        leader = self.engine.forward(plan)
        follower = self.follower.forward(pickle.loads(pickle.dumps(plan)))
        self.pairs.append((leader.next_token_ids, follower.next_token_ids))
        return leader

    def submit(self, plan):
        return asyncio.wrap_future(self._thread.submit(self._both, plan))


def test_plans_replay_identically_on_a_second_engine(llama_path: Path) -> None:
    config = EngineConfig(model=str(llama_path), page_size=4, max_prefill_tokens=16, overlap=True)
    leader, follower = Engine(config), Engine(config)
    executor = MirroringExecutor(leader, follower)
    scheduler = Scheduler(config, model_facts(leader), executor)
    outputs: dict[str, list[int]] = {}
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 11, 25)]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=12, temperature=0.9 if i % 2 else 0.0, seed=i, ignore_eos=True)
        outputs[f"r{i}"] = []
        sink = lambda event, rid=f"r{i}": event.token_id is not None and outputs[rid].append(event.token_id)
        scheduler.submit(Request(f"r{i}", prompt, params, sink))
    asyncio.run(scheduler.run(until_idle=True))
    assert all(len(tokens) == 12 for tokens in outputs.values())
    assert len(executor.pairs) > 12  # chunked prefills and decodes
    for leader_tokens, follower_tokens in executor.pairs:
        assert torch.equal(leader_tokens, follower_tokens)
    executor.shutdown()
