"""Store what `colozoo models` shows of each registered model in its registry file (colozoo/model_configs/<family>.json):
its parameter count and the tp (and, for MoE models, ep) degrees it can be split by, so that `colozoo models` prints
them without importing torch. Run it after adding or changing a registry entry:

    python scripts/update_param_counts.py                 # every file
    python scripts/update_param_counts.py llama.json      # some files

The facts are read off the model as colozoo builds it on the meta device (colozoo.registry.built_facts: tied weights
counted once, each degree checked by building at it); tests/test_registry.py::test_stored_facts fails, naming the
file, when one is missing or stale.
"""
from __future__ import annotations

import sys

from colozoo.registry import CONFIG_DIR, update_stored_facts


def main(argv: list[str]) -> int:
    paths = [CONFIG_DIR / name for name in argv] or sorted(CONFIG_DIR.glob("*.json"))
    for path in paths:
        changed = update_stored_facts(path)
        print(f"{path.name}: {'updated ' + ', '.join(changed) if changed else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
