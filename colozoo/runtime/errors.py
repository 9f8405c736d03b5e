"""Errors of the runtime: a pipeline that cannot be built or scheduled, a training step given bad input."""


class PipelineError(ValueError):
    pass


class TrainingError(ValueError):
    pass
