"""Rank 0 -> followers: each step's batch plan, over the host (gloo) group.

A message is two broadcasts: a fixed header [kind, payload bytes], then the
payload (tp_codec's encoding of the plan). So plans of any size travel on
the CPU, without a device sync, and the receiver sizes its buffer from the
header. Messages are received in the order they were sent, which is the
order the steps execute in.

A ping (rank 0, while idle) is a header every rank answers with a
collective of its own: a broadcast completes on rank 0 once sent, so only a
collective proves that each follower is still receiving. A follower answers
it inside `receive` and goes on waiting for a plan.
"""

from __future__ import annotations

from typing import Any

import torch

from aioserve.tp.distributed import host_broadcast, min_over_ranks
import aioserve.tp.codec as tp_codec

PLAN = 1
STOP = 2
PING = 3


class PlanChannel:
    def send(self, plan: Any) -> None:
        """Rank 0: broadcast one plan (a dataclass; see tp_codec)."""
        payload = tp_codec.encode(plan)
        host_broadcast(torch.tensor([PLAN, payload.numel()], dtype=torch.int64))
        host_broadcast(payload)

    def ping(self) -> None:
        """Rank 0: returns once every follower has answered (it blocks on a
        hung one: the caller bounds it)."""
        host_broadcast(torch.tensor([PING, 0], dtype=torch.int64))
        min_over_ranks(0)

    def send_stop(self) -> None:
        """Rank 0: tell the followers there will be no more steps."""
        host_broadcast(torch.tensor([STOP, 0], dtype=torch.int64))

    def receive(self) -> Any | None:
        """A follower: block until rank 0 sends; the plan, or None for stop.
        Pings on the way are answered."""
        while True:
            header = host_broadcast(torch.zeros(2, dtype=torch.int64))
            kind, size = int(header[0]), int(header[1])
            if kind != PING:
                break
            min_over_ranks(0)
        if kind == STOP:
            return None
        if kind != PLAN:
            raise RuntimeError(f"unknown plan-channel message kind {kind}")
        return tp_codec.decode(host_broadcast(torch.empty(size, dtype=torch.uint8)))
