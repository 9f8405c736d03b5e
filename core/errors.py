"""Errors that several layers of the system raise."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, malformed, or disagrees with the model."""


class UnsupportedConfig(ValueError):
    """A transformers option a family (or a layer) does not implement."""


def require(condition: bool, message: str):
    if not condition:
        raise UnsupportedConfig(message)


def naming(error: OSError, path) -> OSError:
    """`error` naming the file it concerns (the OSError of a write to an open file names none)."""
    if error.filename is None:
        return OSError(error.errno, error.strerror, str(path))
    return error
