"""One worker, in this process (vLLM V1's ``UniProcExecutor``): the model runner runs each message."""
from __future__ import annotations


class UniProcExecutor:
    """``execute_model`` is the runner's; ``runner`` is there for async scheduling, which splits the
    runner's step around the forward pass (:mod:`cbteach.engine.async_scheduling`)."""

    def __init__(self, runner):
        self.runner = runner

    def execute_model(self, scheduler_output):
        return self.runner.execute_model(scheduler_output)

    def generator_state(self, req_id) -> bytes | None:
        """A seeded request's random stream, as bytes (a disaggregated handover carries it along)."""
        return self.runner.generator_state(req_id)

    def close(self) -> None:
        self.runner.close()
