"""Named models shipped with the package: name -> HF repo id, architecture and complete HF config.

The data lives in `colozoo/model_configs/<family>.json`, one file per family, in the format
    {"<name>": {"repo": "<HF repo id>", "architecture": "<transformers class>", "params": <count>,
                "config": {<config.to_dict()>}, "aliases": ["<short name>", ...]}}      # aliases optional
so configs need no network. "params" is the parameter count of the model as colozoo builds it, stored so that
`colozoo models` needs no torch: `python scripts/update_param_counts.py` (re)writes it, and
tests/test_registry.py fails, naming the file, where it is missing or stale.
Names are accepted bare ("opt-30b"), as an alias ("vit-large") or as the repo id
("facebook/opt-30b").
"""
from __future__ import annotations

import difflib
import json
from functools import lru_cache
from pathlib import Path

from colozoo.core.names import human_count

CONFIG_DIR = Path(__file__).parent / "model_configs"


class UnknownModelError(ValueError):
    pass


@lru_cache(maxsize=None)
def registry() -> dict[str, dict]:
    """Every registered model: name -> {"repo", "architecture", "config", "family"}."""
    out = {}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        for name, entry in json.loads(path.read_text()).items():
            if name in out:
                raise ValueError(f"model {name!r} is registered twice ({path.name} and {out[name]['family']}.json)")
            out[name] = {**entry, "family": path.stem}
    return out


@lru_cache(maxsize=None)
def aliases() -> dict[str, str]:
    """Short name -> registered name."""
    out = {}
    for name, entry in registry().items():
        for alias in entry.get("aliases", ()):
            if alias in registry() or alias in out:
                raise ValueError(f"alias {alias!r} of {name!r} is already a registered name or alias")
            out[alias] = name
    return out


def lookup(name: str) -> tuple[str, dict] | None:
    """(name, entry) for a registered name or repo id, else None."""
    models = registry()
    name = aliases().get(name, name)
    if name in models:
        return name, models[name]
    for key, entry in models.items():
        if entry["repo"].lower() == name.lower():
            return key, entry
    return None


def get_entry(name: str) -> tuple[str, dict]:
    found = lookup(name)
    if found is None:
        close = difflib.get_close_matches(name, [*registry(), *aliases()], n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UnknownModelError(f"unknown model {name!r}{hint} (`colozoo models` lists the registry; "
                                f"a local checkpoint directory works too)")
    return found


def config_from_dict(config: dict, architecture: str | None = None):
    import transformers

    config = dict(config)
    model_type = config.pop("model_type")
    config.pop("transformers_version", None)
    out = transformers.AutoConfig.for_model(model_type, **config)
    if architecture and not getattr(out, "architectures", None):
        out.architectures = [architecture]
    return out


COLOZOO_INDEX = "colozoo_index.json"  # a colozoo checkpoint's index (colozoo.checkpoint.format), holding its config


def check_positions(config, tokens: int, what: str):
    """One wording for every command whose sequences would run past the model's position table: `what` names the
    length (e.g. "--seq-len 4096")."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and tokens > positions:
        raise ValueError(f"{what} is longer than the model's maximum positions ({positions})")


def looks_like_a_path(name: str) -> bool:
    """A name no registry entry or HF repo id has: it starts with '.', '/' or '~', or has more than one '/'."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def get_config(name: str):
    """The transformers config object of a registered model, or of a local HF or colozoo directory (no network)."""
    if Path(name).exists():
        return local_config(Path(name))
    if looks_like_a_path(name) and lookup(name) is None:
        raise FileNotFoundError(f"no checkpoint at {name} (no such directory)")  # colozoo.api.resolve's words
    _, entry = get_entry(name)
    return config_from_dict(entry["config"], entry["architecture"])


def local_config(path: Path):
    """The config of a model directory: a colozoo checkpoint's index or an HF config.json."""
    index = path / COLOZOO_INDEX
    try:
        if index.is_file():
            data = json.loads(index.read_text())
            return config_from_dict(data["config"], data.get("architecture"))
        if (path / "config.json").is_file():
            from colozoo.models import text_config

            return text_config(hf_config(path))
    except UnknownModelError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the model config in {path}: {e}") from None
    raise ValueError(f"{path} is not a model directory (no config.json or {COLOZOO_INDEX})")


def hf_config(path: Path):
    """transformers' config of an HF directory. A model type transformers does not know, written for remote code
    (Kimi-K2's kimi_k2, whose architecture is DeepseekV3ForCausalLM), reads as its architecture's when transformers
    has that class: the remote code is never run, nor asked about."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = json.loads((Path(path) / "config.json").read_text())
    architecture = (data.get("architectures") or [""])[0]
    model_class = getattr(transformers, architecture, None) if architecture.endswith("ForCausalLM") else None
    if data.get("model_type") not in CONFIG_MAPPING and model_class is not None:
        data.pop("auto_map", None)
        return config_from_dict({**data, "model_type": model_class.config_class.model_type}, architecture)
    if data.get("model_type") not in CONFIG_MAPPING:  # transformers would suggest (or prompt for) remote code
        raise UnknownModelError(unknown_model_type(path, data))
    return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)


def unknown_model_type(path, data: dict) -> str:
    """One line on a config whose model type neither transformers nor colozoo builds (never: run remote code)."""
    from colozoo.models.family import families

    remote = " (its config.json points at custom code in auto_map: colozoo never runs code from a model directory)" \
        if "auto_map" in data else ""
    architecture = (data.get("architectures") or [None])[0]
    return (f"{Path(path) / 'config.json'}: model type {data.get('model_type')!r}"
            f"{f' ({architecture})' if architecture else ''} is not one colozoo builds{remote}; colozoo builds "
            f"{', '.join(sorted(families()))}")


def count_parameters(config) -> int | None:
    """Parameters of the model as colozoo builds it, counted as transformers counts them (ParallelModel.num_parameters:
    tied weights once, transformers' buffers not); None if the family is not available."""
    from colozoo.models import build_shard
    from colozoo.core.mesh import ParallelContext

    try:
        model = build_shard(config, pc=ParallelContext.virtual(), device="meta")
    except (ImportError, ValueError):
        return None
    return model.num_parameters()


def stored_param_counts(path: Path) -> dict[str, tuple]:
    """{name: (stored "params" or "missing", count of the meta-built model)} for every model of one registry file."""
    return {name: (entry.get("params", "missing"),
                   count_parameters(config_from_dict(entry["config"], entry["architecture"])))
            for name, entry in json.loads(Path(path).read_text()).items()}


def update_param_counts(path: Path) -> list[str]:
    """Store every model's parameter count in its registry file (after "architecture"); the names changed."""
    path = Path(path)
    text = path.read_text()
    counts = stored_param_counts(path)
    changed = [name for name, (stored, actual) in counts.items() if stored != actual]
    if changed:
        models = {}
        for name, entry in json.loads(text).items():
            entry = {k: v for k, v in entry.items() if k != "params"}
            keys = list(entry)
            at = keys.index("architecture") + 1 if "architecture" in keys else len(keys)
            items = list(entry.items())
            models[name] = dict(items[:at] + [("params", counts[name][1])] + items[at:])
        path.write_text(json.dumps(models, indent=1) + ("\n" if text.endswith("\n") else ""))
    return changed


def print_models(file=None):
    from rich.console import Console
    from rich.table import Table

    table = Table(title="colozoo models")
    for column in ("name", "family", "params", "repo"):
        table.add_column(column, justify="right" if column == "params" else "left")
    for name, entry in registry().items():
        params = entry.get("params")
        if params is None:  # a file not yet updated by scripts/update_param_counts.py: count (imports torch)
            params = count_parameters(config_from_dict(entry["config"], entry["architecture"]))
        shown = f"{name} ({', '.join(entry['aliases'])})" if entry.get("aliases") else name
        table.add_row(shown, entry["family"], human_count(params), entry["repo"])
    Console(file=file, width=120).print(table)


def add_parser(subparsers):
    parser = subparsers.add_parser("models", help="list the named models of the registry")
    parser.set_defaults(func=lambda args: print_models())
