"""Build the engine, its executor and the scheduler over them from one config."""

from __future__ import annotations

from aioserve.config import EngineConfig
from aioserve.engine.engine import Engine
from aioserve.engine.executor import create_executor
from aioserve.scheduler.scheduler import ModelFacts, Scheduler


def model_facts(engine: Engine) -> ModelFacts:
    return ModelFacts(
        num_pages=engine.num_pages,
        page_size=engine.page_size,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        eos_token_ids=engine.model_config.eos_token_ids,
    )


def build_scheduler(config: EngineConfig) -> tuple[Engine, Scheduler]:
    engine = Engine(config)
    return engine, Scheduler(config, model_facts(engine), create_executor(engine))
