"""CUDA graphs for verification steps: a speculating step as one replay.

A speculative step verifies k proposed tokens per request: each speculating
request is an extend of k + 1 rows (its newest token and the proposals),
beside plain decodes of one row. Run eagerly that is a prefill-shaped
forward, whose kernel launches cost the host far more than the GPU's work
(Qwen3-0.6B on an H200: ~16 ms a verification against a 1.9 ms decode
replay, which made every proposer a loss). The verify graphs capture it.

A graph freezes shapes, so each captured batch size `bs` has a fixed row
count, `bs * (k + 1) + 1`, and a fixed request count, `bs + 1`, and a step
of n <= bs requests and T rows (any mix of decodes and extends of at most
k + 1 rows) is padded to both:

* its own n requests and T rows, first, in the plan's order;
* `bs - n` padding requests of one row each, as the decode graphs pad;
* one last padding request that takes every row still left (at least one),
  so that the attention kernel always sees the capture's row count (what
  FlashInfer's graph-mode prefill plan sizes its work lists by).

Padding rows read token 0 at position 0 and write their K/V to the scratch
slot of the reserved page 0; the last request's KV is page 0 repeated, as
many pages as its rows need: its reads are of finite values nobody uses.
Only the first T rows' hidden states are returned.

Steps that fit run here when no decode graph serves them; images, prompt
logprobs and LoRA adapters keep to the eager path. A capture that fails
leaves the verifications eager (Engine.capture_speculation_graphs logs why).
"""

from __future__ import annotations

import torch

from aioserve.attention.backend import AttentionMetadata
from aioserve.batch_plan import BatchPlan
from aioserve.engine.cuda_graph import SCRATCH_SLOT, GraphTarget, StepGraphRunner


def verify_rows(batch_size: int, tokens_per_request: int) -> int:
    """Rows of the verify graph for `batch_size` requests (one more for the last padding request)."""
    return batch_size * tokens_per_request + 1


def pad_verify_plan(plan: BatchPlan, batch_size: int, tokens_per_request: int, page_size: int) -> BatchPlan:
    """`plan` padded to the verify graph of `batch_size` (see the module doc):
    `batch_size + 1` requests, `verify_rows(...)` rows, every request an
    extend (num_decodes 0); sampling dropped."""
    n, t = plan.num_requests, plan.num_tokens
    if n > batch_size:
        raise ValueError(f"{n} requests do not fit a verify graph of {batch_size}")
    if n and int(plan.extend_lens.max()) > tokens_per_request:
        raise ValueError(f"a request adds more than {tokens_per_request} tokens: no verify graph holds it")
    rows = verify_rows(batch_size, tokens_per_request)
    singles = batch_size - n
    last = rows - t - singles  # >= 1: each real request has at most tokens_per_request rows
    pad_rows = rows - t
    long = torch.long
    lengths = torch.cat([torch.ones(singles, dtype=long), torch.tensor([last], dtype=long)])
    last_pages = -(-last // page_size)
    width = max(int(plan.page_table.shape[1]), last_pages)
    page_table = torch.zeros(batch_size + 1, width, dtype=torch.int32)  # padding: page 0 throughout
    page_table[:n, : plan.page_table.shape[1]] = plan.page_table
    return BatchPlan(
        step=plan.step,
        input_ids=torch.cat([plan.input_ids, torch.zeros(pad_rows, dtype=long)]),
        positions=torch.cat([plan.positions, torch.zeros(pad_rows, dtype=long)]),
        out_cache_loc=torch.cat([plan.out_cache_loc, torch.full((pad_rows,), SCRATCH_SLOT, dtype=long)]),
        seq_lens=torch.cat([plan.seq_lens, lengths]),
        extend_lens=torch.cat([plan.extend_lens, lengths]),
        page_table=page_table,
        num_decodes=0,
        logits_indices=torch.zeros(0, dtype=long),
        sampling=None,
    )


class VerifyGraphRunner(StepGraphRunner):
    """Steps of at most `tokens_per_request` new tokens a request (not decode-only)."""

    kind = "verify"

    def __init__(self, target: GraphTarget, max_bs: int, tokens_per_request: int, page_size: int) -> None:
        if tokens_per_request < 2:
            raise ValueError("a verify graph holds at least two tokens a request (one proposed)")
        self.tokens_per_request = tokens_per_request
        self.page_size = page_size
        super().__init__(target, max_bs)

    def rows(self, batch_size: int) -> int:
        return verify_rows(batch_size, self.tokens_per_request)

    def _init_attention_buffers(self) -> None:
        # Every real request's pages, then a page for each padding request
        # and the last one's pages (page 0 repeated).
        pages = self.max_bs * self.max_pages_per_request + self.max_bs + -(-self.rows(self.max_bs) // self.page_size)
        self.attention.init_verify_graph_buffers(self.max_bs + 1, pages)

    def _attention_metadata(self, batch_size: int) -> AttentionMetadata:
        return self.attention.verify_graph_metadata(batch_size + 1, self.out_cache_loc[: self.rows(batch_size)])

    def _padded(self, host_plan: BatchPlan, batch_size: int) -> BatchPlan:
        return pad_verify_plan(host_plan, batch_size, self.tokens_per_request, self.page_size)

    def _update_attention(self, padded: BatchPlan) -> None:
        self.attention.update_verify_graph_buffers(padded)

    def can_run(self, host_plan: BatchPlan) -> bool:
        return (
            not host_plan.is_decode_only  # the decode graphs' (fewer rows)
            and host_plan.num_requests <= self.max_bs
            and int(host_plan.extend_lens.max()) <= self.tokens_per_request
            and not host_plan.has_image_rows
            and host_plan.prompt_logprobs is None
            and (host_plan.lora is None or not host_plan.lora.uses_adapters)
            and host_plan.pooling is None
        )
