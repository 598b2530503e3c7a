"""Exceptions the frontend raises in the caller's process."""


class PipelineError(RuntimeError):
    """Base class for failures of the process group (not of the caller's input)."""


class EngineDeadError(PipelineError):
    """The engine core exited or could not start; the group is closed."""


class EngineRestartedError(EngineDeadError):
    """An engine core died while this call had requests in it (or on their way to it): the call
    fails as a whole; the engine core was restarted and the Pipeline stays usable."""


class WorkerStartError(PipelineError):
    """A render worker could not start (e.g. the tokenizer failed to load)."""


class StepError(PipelineError):
    """A model step raised in the engine core; its requests were aborted there."""

    def __init__(self, message: str, request_ids: list[str], indices: list[int]) -> None:
        super().__init__(message)
        self.request_ids = request_ids
        self.indices = indices
