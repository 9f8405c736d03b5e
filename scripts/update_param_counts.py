"""Store each registered model's parameter count in its registry file (colozoo/model_configs/<family>.json), so
that `colozoo models` prints them without importing torch. Run it after adding or changing a registry entry:

    python scripts/update_param_counts.py                 # every file
    python scripts/update_param_counts.py llama.json      # some files

Counts are those of the model as colozoo builds it on the meta device (tied weights once);
tests/test_registry.py::test_stored_parameter_counts fails, naming the file, when one is missing or stale.
"""
from __future__ import annotations

import sys

from colozoo.registry import CONFIG_DIR, update_param_counts


def main(argv: list[str]) -> int:
    paths = [CONFIG_DIR / name for name in argv] or sorted(CONFIG_DIR.glob("*.json"))
    for path in paths:
        changed = update_param_counts(path)
        print(f"{path.name}: {'updated ' + ', '.join(changed) if changed else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
