"""Request lifecycle: admission, chunked prefill, decode batches, the async loop."""

from aioserve.scheduler.request import Request, RequestEvent, RequestRejected, Status
from aioserve.scheduler.scheduler import ModelFacts, Scheduler, SchedulerStats

__all__ = ["ModelFacts", "Request", "RequestEvent", "RequestRejected", "Scheduler", "SchedulerStats", "Status"]
