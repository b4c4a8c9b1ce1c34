"""AsyncMMEngine's refusals of a request (besides EngineDeadError, mmengine.errors): in a module of their own that
imports no engine, so that what only maps them (the server's error handlers, and through its protocol models the
data-parallel router on Ray Serve) starts without torch and the model code."""

from __future__ import annotations

from mmengine.errors import MMEngineError


class EngineOverloadedError(MMEngineError, RuntimeError):
    """More requests wait for their first token than `max_queued_requests` allows; retry later."""

    def __init__(self, reason: str, retry_after: int = 1) -> None:
        self.reason = reason
        self.retry_after = retry_after  # seconds
        super().__init__(reason)

    def __reduce__(self):
        return (self.__class__, (self.reason, self.retry_after))


class RequestFailedError(MMEngineError, RuntimeError):
    """A request the engine failed: steps kept raising while it was in flight, and the newest request
    is removed until they run again. The requests left keep running."""
