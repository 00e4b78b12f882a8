"""One worker, in this process (vLLM V1's ``UniProcExecutor``): the model runner runs each message."""
from __future__ import annotations


class UniProcExecutor:
    """``execute_model`` is the runner's; ``pipeline``, if given, keeps one step in flight (``non_block=True``)."""

    def __init__(self, runner, pipeline=None):
        self.runner, self.pipeline = runner, pipeline

    def execute_model(self, scheduler_output, non_block: bool = False):
        """Run the message's step and return its output (``non_block``: the previous step's, or ``None``)."""
        if non_block != (self.pipeline is not None):
            raise ValueError(f"this executor was built for non_block={self.pipeline is not None}: "
                             f"execute_model(non_block={non_block}) cannot run here")
        return (self.pipeline or self.runner).execute_model(scheduler_output)

    def drain(self):
        """Finish the step in flight (``non_block``) and return its output (``None`` if none)."""
        return self.pipeline.drain() if self.pipeline is not None else None

    def generator_state(self, req_id) -> bytes | None:
        """A seeded request's random stream, as bytes."""
        return self.runner.generator_state(req_id)

    def close(self) -> None:
        (self.pipeline or self.runner).close()
