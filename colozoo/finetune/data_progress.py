"""Progress while a dataset is tokenized (once, into OUTPUT/data-cache): a bar on a terminal, as training shows, else a
line every PLAIN_EVERY_S seconds; then one line with what was made of it."""
from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

PLAIN_EVERY_S = 10.0


def record_count(path) -> int | None:
    """How many records `path` holds, found without parsing them (the bar's total): the lines of a JSON lines file,
    the rows a Parquet file's metadata counts; None when that is not cheap (plain text, Arrow, datasets)."""
    path = Path(path)
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet

            return pyarrow.parquet.ParquetFile(path).metadata.num_rows
        if path.is_file() and path.suffix != ".txt":
            with open(path, "rb") as f:
                return sum(1 for line in f if line.strip())
    except (OSError, ImportError, ValueError):
        pass
    return None


class TokenizingProgress:
    def __init__(self, path, enabled: bool):
        self.path, self.enabled = path, enabled
        self.started = self.printed = time.monotonic()
        self.total = record_count(path) if enabled else None
        self.console = Console(stderr=True)
        self.bar = None
        if enabled and self.console.is_terminal:
            self.bar = Progress(TextColumn(f"[bold]tokenizing {Path(path).name}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("records  ETA"), TimeRemainingColumn(), console=self.console,
                                transient=True)
            self.task = self.bar.add_task("tokenize", total=self.total)
            self.bar.start()

    def update(self, records: int):
        if self.bar is not None:
            self.bar.update(self.task, completed=records)
        elif self.enabled and time.monotonic() - self.printed >= PLAIN_EVERY_S:
            self.printed = time.monotonic()
            share = f"{100 * records / self.total:.0f}% ({records:,} of {self.total:,} records)" if self.total \
                else f"{records:,} records"
            self.console.print(f"tokenizing {self.path}: {share}, {self.printed - self.started:.0f} s",
                               highlight=False, soft_wrap=True)

    def close(self, records: int | None = None, rows: int | None = None, seq_len: int | None = None):
        """The bar ends; with `rows`, the closing line (the tokenizing succeeded)."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        if self.enabled and rows is not None:
            read = f"{records:,} records of " if records else ""
            self.console.print(f"tokenized {read}{self.path} into {rows:,} rows of {seq_len} tokens in "
                               f"{time.monotonic() - self.started:.1f} s", highlight=False, soft_wrap=True)
