"""The plan codec (what rank 0 broadcasts): every field of a plan travels,
fields added later included, without pickle; real plans replay to the same
tokens after a round trip."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from aioserve import batch_plan
from aioserve.batch_plan import AdapterLoad, BatchPlan, LoraBatch, PoolingRequest, PromptLogprobRequest, SamplingTensors
from aioserve.config import EngineConfig
from aioserve.tp import codec as tp_codec
from aioserve.engine.engine import Engine
from aioserve.engine.executor import ThreadExecutor
from aioserve.batch_plan import DraftBatch, ImageBatch, ImageRows, ImageToEncode
from aioserve.sampling_params import SamplingParams
from aioserve.scheduler import Request, Scheduler
from aioserve.launch.wiring import model_facts


def _filled(cls: type, seed: int) -> object:
    """An instance of a plan dataclass with every field set to a distinct
    value of its kind, whatever the fields are (so new ones are covered)."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        kind = str(f.type)
        if "SamplingTensors" in kind:
            values[f.name] = _filled(SamplingTensors, seed + 1)
        elif "PromptLogprobRequest" in kind:
            values[f.name] = _filled(PromptLogprobRequest, seed + 2)
        elif "PoolingRequest" in kind:
            values[f.name] = _filled(PoolingRequest, seed + 3)
        elif "LoraBatch" in kind:
            values[f.name] = LoraBatch(torch.tensor([0, 2, 1]), [AdapterLoad(2, 7, "/adapters/a"), AdapterLoad(1, 9, "b")])
        elif "ImageBatch" in kind:  # pixels in float32 and bfloat16, a 62-bit key
            pixels = torch.randn(6, 12, generator=generator)
            encode = [ImageToEncode(2**61 + 5, ["image_grid_thw", "pixel_values"], [torch.tensor([[1, 2, 4]]), pixels]),
                      ImageToEncode(3, ["pixel_values"], [pixels.to(torch.bfloat16)])]
            values[f.name] = ImageBatch([11, 2**62 - 1], encode, [ImageRows(4, 3, 0, 2), ImageRows(9, 2**61 + 5, 1, 3)])
        elif "DraftBatch" in kind:  # a draft model's verifications: host lists
            values[f.name] = DraftBatch([0, 2], [1, 9], [3, 2])
        elif "Tensor" in kind:
            shape = (3, 5) if f.name in ("page_table", "grammar_bitmask") else (7 + i,)
            dtype = {"page_table": torch.int32, "grammar_bitmask": torch.int32}.get(f.name)
            if dtype is None:
                dtype = torch.float64 if f.name == "uniforms" else torch.float32 if "float" in f.name else torch.int64
            values[f.name] = (torch.randn(shape, generator=generator) * 1000).to(dtype)
        elif kind == "bool":
            values[f.name] = i % 2 == 0
        elif kind == "int":
            values[f.name] = 100 + i
        elif kind == "str":
            values[f.name] = f"value {i}"
        else:
            raise AssertionError(f"add a value kind for {cls.__name__}.{f.name}: {kind}")
    return cls(**values)


def assert_same(a: object, b: object, path: str = "plan") -> None:
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_every_field_of_a_plan_round_trips() -> None:
    plan = _filled(BatchPlan, 0)
    buffer = tp_codec.encode(plan)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert_same(plan, tp_codec.decode(buffer))
    empty = dataclasses.replace(plan, sampling=None, prompt_logprobs=None, pooling=None, input_ids=torch.zeros(0, dtype=torch.long))
    assert_same(empty, tp_codec.decode(tp_codec.encode(empty)))


def test_a_field_added_later_travels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new plan dataclass with new kinds of fields (as the grammar work adds
    tensors to SamplingTensors) needs no change to the codec."""
    extended = dataclasses.make_dataclass(
        "ExtendedSampling",
        [("mask", torch.Tensor), ("flags", torch.Tensor), ("names", tuple), ("scale", float), ("note", str | None),
         ("inner", object), ("later", int, dataclasses.field(default=0, init=False))],
    )
    extended.__module__ = "aioserve.batch_plan"
    monkeypatch.setattr(batch_plan, "ExtendedSampling", extended, raising=False)
    inner = _filled(PromptLogprobRequest, 3)
    value = extended(
        mask=torch.arange(12, dtype=torch.int32).reshape(3, 4)[:, ::2],  # not contiguous
        flags=torch.tensor([True, False, True]),
        names=("a", 1, None, [2.5, float("inf")]),
        scale=-0.1,
        note=None,
        inner=inner,
    )
    value.later = 7
    back = tp_codec.decode(tp_codec.encode(value))
    assert_same(value, back)
    assert back.later == 7 and back.mask.is_contiguous()


def test_refuses_what_it_cannot_carry() -> None:
    @dataclasses.dataclass
    class Foreign:  # not an aioserve dataclass
        x: int

    with pytest.raises(TypeError, match="only aioserve dataclasses"):
        tp_codec.encode(Foreign(1))
    plan = _filled(BatchPlan, 1)
    with pytest.raises(TypeError, match=r"BatchPlan\.input_ids: cannot broadcast a dict"):
        tp_codec.encode(dataclasses.replace(plan, input_ids={"a": 1}))
    with pytest.raises(TypeError, match="complex64"):
        tp_codec.encode(dataclasses.replace(plan, positions=torch.zeros(2, dtype=torch.complex64)))
    # A forged description may not build arbitrary classes.
    good = tp_codec.encode(plan)
    forged = bytes(good.numpy()).replace(b"aioserve.batch_plan:BatchPlan", b"os:system".ljust(29, b"_"))
    with pytest.raises(ValueError, match="not an aioserve dataclass"):
        tp_codec.decode(torch.frombuffer(bytearray(forged), dtype=torch.uint8))


class CodecMirror(ThreadExecutor):
    """Runs each plan on the scheduler's engine and, after encode/decode,
    on a second engine; records both tokens."""

    def __init__(self, engine: Engine, follower: Engine) -> None:
        super().__init__(engine)
        self.follower = follower
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _both(self, plan: BatchPlan):
        leader = self.engine.forward(plan)
        follower = self.follower.forward(tp_codec.decode(tp_codec.encode(plan)))
        self.pairs.append((leader.next_token_ids, follower.next_token_ids))
        return leader

    def submit(self, plan: BatchPlan):
        return asyncio.wrap_future(self._thread.submit(self._both, plan))


def test_scheduled_plans_replay_identically_after_the_codec(llama_path: Path) -> None:
    config = EngineConfig(model=str(llama_path), page_size=4, max_prefill_tokens=16, overlap=True)
    leader, follower = Engine(config), Engine(config)
    executor = CodecMirror(leader, follower)
    scheduler = Scheduler(config, model_facts(leader), executor)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 11, 25)]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_tokens=10, temperature=0.9 if i % 2 else 0.0, seed=i, ignore_eos=True,
            repetition_penalty=1.2 if i == 1 else 1.0, frequency_penalty=0.5 if i == 2 else 0.0,
            prompt_logprobs=1 if i == 3 else None,
        )
        scheduler.submit(Request(f"r{i}", prompt, params, lambda event: None))
    asyncio.run(scheduler.run(until_idle=True))
    assert len(executor.pairs) > 10  # chunked prefills and decodes, placeholders in the penalty lists
    for leader_tokens, follower_tokens in executor.pairs:
        assert torch.equal(leader_tokens, follower_tokens)
    executor.shutdown()
