"""Errors that several layers of the system raise."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, malformed, or disagrees with the model."""


class UnsupportedConfig(ValueError):
    """A transformers option a family (or a layer) does not implement."""


def require(condition: bool, message: str):
    if not condition:
        raise UnsupportedConfig(message)
