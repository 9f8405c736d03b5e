"""Errors that several layers of the system raise."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, malformed, or disagrees with the model."""
