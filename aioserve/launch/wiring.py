"""Build the engine, its executor and the scheduler over them from one config.

With `tp_size` > 1 (or several nodes) this process becomes rank 0: it starts
node 0's follower ranks, joins the group, and its executor broadcasts every
plan before running it (launch/leader.py). The scheduler itself does not
know: it plans for rank 0's engine as it always does.
"""

from __future__ import annotations

from collections.abc import Callable

from aioserve.config import ConfigError, EngineConfig
from aioserve.engine.engine import Engine
from aioserve.engine.executor import start_executor
from aioserve.launch.leader import TPLeader
from aioserve.launch.world import is_distributed
from aioserve.scheduler.scheduler import ModelFacts, Scheduler
from aioserve.lora_config import AdapterError, LoraConfig, resolve_lora
from aioserve.speculative_config import resolve_speculative


def model_facts(engine: Engine) -> ModelFacts:
    return ModelFacts(
        num_pages=engine.num_pages,
        page_size=engine.page_size,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        eos_token_ids=engine.model_config.eos_token_ids,
        max_prefill_tokens=engine.max_prefill_tokens,
        pooler=engine.pooler,
        read_adapter=engine.lora.preload if engine.lora is not None else None,
        forget_adapter=engine.lora.forget if engine.lora is not None else None,
        takes_images=engine.images is not None,
    )


def build_scheduler(
    config: EngineConfig, on_tp_failure: Callable[[str], None] | None = None
) -> tuple[Engine, Scheduler]:
    """`on_tp_failure(reason)` is called (from another thread) when a
    tensor-parallel rank dies or a step fails: the group cannot go on."""
    resolve_speculative(config)  # a bad speculative setting is refused before any weight loads
    lora = resolve_lora(config)  # and a bad LoRA one
    if not is_distributed(config):
        engine, executor = start_executor(config)
        return engine, _with_adapters(Scheduler(config, model_facts(engine), executor), lora)
    leader = TPLeader(config, on_tp_failure)
    try:
        engine, executor = start_executor(leader.rank_config, leader)
    except BaseException:
        leader.close()
        raise
    return engine, _with_adapters(Scheduler(config, model_facts(engine), executor), lora)


def _with_adapters(scheduler: Scheduler, lora: LoraConfig | None) -> Scheduler:
    """The adapters named at start (--lora-modules), read before the server
    listens; one that cannot be served stops the start with its reason."""
    for source in lora.adapters if lora is not None else ():
        try:
            scheduler.load_adapter_now(source.name, source.path)
        except AdapterError as exc:
            scheduler.shutdown()
            raise ConfigError(f"--lora-modules {source.name}: {exc}") from None
    return scheduler
