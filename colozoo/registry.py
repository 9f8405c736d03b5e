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


def check_model_name(name: str):
    """Refuses, without torch, a name that can name nothing: a path that does not exist (colozoo.api.resolve's words),
    or a bare name the registry does not know (an owner/name repo id may still be in the local Hugging Face cache)."""
    if Path(name).exists() or lookup(name) is not None:
        return
    if looks_like_a_path(name):
        raise FileNotFoundError(f"no checkpoint at {name} (no such directory)")
    if "/" not in name:
        get_entry(name)  # the unknown-name error, with suggestions


def get_config(name: str):
    """The transformers config object of a registered model, or of a local HF or colozoo directory (no network)."""
    if Path(name).exists():
        return local_config(Path(name))
    check_model_name(name)
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
    model = _meta_model(config)
    return model.num_parameters() if model is not None else None


def _meta_model(config, layer_ids=None, **degrees):
    """The whole model (or `layer_ids` of it) built on meta at these degrees; None if the family is not available.
    Building checks the degrees: ValueError when the model cannot be split so."""
    from colozoo.models import build_shard
    from colozoo.core.mesh import ParallelContext

    try:
        return build_shard(config, parallel=ParallelContext.virtual(**degrees), layer_ids=layer_ids, device="meta")
    except ImportError:
        return None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def built_facts(config) -> dict:
    """What `colozoo models` shows without torch, read off the model colozoo builds of `config` on meta: "params"
    (None if the family is not available), "tp" (the tp degrees it builds at: divisors of the attention heads that
    also suit the key/value heads, the MLP and expert widths) and for MoE models "ep" (the divisors of the experts
    it builds at). Each degree is checked by building one layer of each kind at it."""
    try:
        model = _meta_model(config)
    except ValueError:
        model = None
    if model is None:
        return {"params": None}
    kinds = {}  # a layer kind: its parameters' names and shapes (dense or MoE, MLA, ...); one of each is built
    for index, layer in model.layers.items():
        kinds.setdefault(tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()), int(index))
    layers = sorted(kinds.values())

    def builds(**degrees) -> bool:
        try:
            return _meta_model(config, layers, **degrees) is not None
        except ValueError:
            return False

    facts = {"params": model.num_parameters(), "tp": [t for t in divisors(config.num_attention_heads) if builds(tp=t)]}
    experts = getattr(model, "num_experts", None)
    if experts:
        facts["ep"] = [e for e in divisors(experts) if builds(dp=e, ep=e)]
    return facts


STORED = ("params", "tp", "ep")  # what a registry entry stores of built_facts, after "architecture"


def stored_facts(path: Path) -> dict[str, tuple[dict, dict]]:
    """{name: (what the entry stores of built_facts, "missing" where it stores nothing; built_facts)} for every
    model of one registry file."""
    found = {}
    for name, entry in json.loads(Path(path).read_text()).items():
        built = built_facts(config_from_dict(entry["config"], entry["architecture"]))
        found[name] = ({k: entry.get(k, "missing") for k in built}, built)
    return found


def update_stored_facts(path: Path) -> list[str]:
    """Store every model's built_facts in its registry file (after "architecture"); the names changed."""
    path = Path(path)
    text = path.read_text()
    facts = stored_facts(path)
    changed = [name for name, (stored, built) in facts.items() if stored != built]
    if changed:
        models = {}
        for name, entry in json.loads(text).items():
            entry = {k: v for k, v in entry.items() if k not in STORED}
            keys = list(entry)
            at = keys.index("architecture") + 1 if "architecture" in keys else len(keys)
            items = list(entry.items())
            models[name] = dict(items[:at] + list(facts[name][1].items()) + items[at:])
        path.write_text(json.dumps(models, indent=1) + ("\n" if text.endswith("\n") else ""))
    return changed


def degrees_text(degrees: list[int] | None, width: int = 14) -> str:
    """Allowed degrees in at most about `width` characters: all of them, else "1,2,4,…,128" for the powers of two up
    to 128, or "divisors of 72"."""
    if not degrees:
        return "-"
    text, top = ",".join(map(str, degrees)), degrees[-1]
    if len(text) > width and degrees == [2 ** i for i in range(len(degrees))]:
        return f"1,2,4,…,{top}"
    if len(text) > width and degrees == divisors(top):
        return f"divisors of {top}"
    return text


def _row(name: str, entry: dict | None, config=None) -> tuple[str, ...]:
    """A table row: a registered model (its stored facts, built where a file lacks them) or a model directory."""
    if entry is not None:
        facts = {k: entry[k] for k in STORED if k in entry}
        if "params" not in facts or "tp" not in facts:  # a file not yet updated by scripts/update_param_counts.py
            facts = built_facts(config_from_dict(entry["config"], entry["architecture"]))
        shown = f"{name} ({', '.join(entry['aliases'])})" if entry.get("aliases") else name
        family, repo = entry["family"], entry["repo"]
    else:
        facts, shown, family, repo = built_facts(config), name, config.model_type, "(local directory)"
    return (shown, family, human_count(facts["params"]), degrees_text(facts.get("tp")), degrees_text(facts.get("ep")),
            repo)


def print_models(names: list[str] | None = None, file=None):
    """The registry as a table (or the models `names`: registry names or model directories)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title="colozoo models (tp, ep: the degrees each splits by; `colozoo models --help` says why)",
                  box=box.SIMPLE_HEAD)
    for column in ("name", "family", "params", "tp", "ep", "repo"):
        table.add_column(column, justify="right" if column == "params" else "left", no_wrap=True)
    for name in names or registry():
        found = None if Path(name).exists() else lookup(name)
        table.add_row(*(_row(found[0], found[1]) if found else _row(name, None, get_config(name))))
    Console(file=file, width=140).print(table)  # the longest names and repo ids whole, on one line


def family_table() -> str:
    """The README's table of families, in Markdown, from the family table (colozoo.models.family, which imports the
    model files and torch): each family's title, the transformers classes it builds, what it is, its registry names."""
    from colozoo.models import families

    lines = ["| family | classes | what it is | registry names (configs ship offline) |", "|---|---|---|---|"]
    for family in sorted({f.name: f for f in families().values()}.values(), key=lambda f: f.name):
        classes = list(getattr(family.model, "TASKS", {}).values()) or [family.model.__name__]
        names = [n for n, entry in registry().items() if entry["family"] == family.name]
        lines.append(f"| {family.title or family.name} (`{family.name}`) | {', '.join(classes)} | {family.features} | "
                     f"{', '.join(names) or '-'} |")
    return "\n".join(lines) + "\n"


MODELS_HELP = ("Each model's parameters, and the degrees it can be split by: tp must divide the attention heads, "
               "divide the key/value heads or be a multiple of them (each kv head then replicated), and divide the "
               "MLP (and expert) widths; the vocabulary is padded, so it never constrains tp. ep (MoE models) must "
               "divide the experts. pp splits whole layers. Give registry names or model directories to list only "
               "those.")


def add_parser(subparsers):
    parser = subparsers.add_parser("models", help="list the registry's models with the tp (and ep) degrees each allows",
                                   description=MODELS_HELP)
    parser.add_argument("names", nargs="*", metavar="MODEL", help="registry names or model directories (default: "
                                                                   "the whole registry)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the table of families (title, classes, features, registry names) in Markdown, "
                             "as the README holds it, instead of the models")
    parser.set_defaults(func=lambda args: print(family_table(), end="") if args.markdown else print_models(args.names))
