"""Request lifecycle: admission, chunked prefill, decode batches, the async loop."""

from aioserve.scheduler.request import Request, RequestEvent, RequestRejected, Status
from aioserve.scheduler.client import SchedulerClient, SchedulerInfo
from aioserve.scheduler.scheduler import ModelFacts, Scheduler, SchedulerStats

__all__ = [
    "ModelFacts", "Request", "RequestEvent", "RequestRejected", "Scheduler", "SchedulerClient", "SchedulerInfo",
    "SchedulerStats", "Status",
]
