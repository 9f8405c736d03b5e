"""Writing a file whole or not at all."""
from __future__ import annotations

import os
from pathlib import Path

from colozoo.core.errors import naming


def fsync_write(path, write):
    """Write via a temp file + fsync + rename, so `path` is either absent or whole; `write(f)` fills the binary
    file `f`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise naming(e, path) from None
