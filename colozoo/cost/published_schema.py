"""What a row of a published-runs table may say: the package's table (colozoo/cost/published_runs.json) or a user's
own runs given to `colozoo plan --validate --runs FILE`. Every key is checked, so a misspelt one is an error that
names the row and the key instead of a default priced in silence."""
from __future__ import annotations

from dataclasses import fields

from colozoo.cost.software import Software


class PublishedRunError(ValueError):
    pass


REQUIRED = ("id", "source", "hardware", "gpus", "model", "layout", "measured")
OPTIONAL = ("group", "held_out", "network", "dtype", "attention", "software", "notes", "known_miss", "memory_miss")
MODEL = ("registry", "family", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "tied", "dropout",
         "flops", "experts_per_token")
MODEL_SIZES = ("hidden", "layers", "heads", "vocab")  # what a model given by family needs besides its sequence
FAMILIES = ("gpt2", "llama")
LAYOUT = ("tp", "pp", "dp", "cp", "ep", "micro_batch", "global_batch", "recompute", "sequence_parallel", "zero",
          "virtual_stages", "layers_per_stage", "balance", "schedule", "reshard_after_forward")
UNITS = ("narayanan2021", "megatron_core", "tokens_per_gpu", "step_seconds")


def check_shape(data) -> None:
    ok = isinstance(data, dict) and isinstance(data.get("runs"), list)
    if not ok or not all(isinstance(data.get(k, {}), dict) for k in ("software", "networks")):
        raise PublishedRunError('a published-runs table is a JSON object with a list "runs" (and optionally objects '
                                '"software" and "networks" of presets besides the package\'s)')


def check_presets(software: dict) -> None:
    """Every software preset names only Software's fields, and a `base` it builds on that is a preset (or colozoo),
    with no preset its own base however far down."""
    for name, spec in software.items():
        _software(spec, software, f"software preset {name!r}", ("base", "source"))
    for name in software:
        chain = [name]
        while (base := software[chain[-1]].get("base", "colozoo")) != "colozoo":
            if base in chain:
                raise PublishedRunError(f"software presets build on each other in a circle: "
                                        f"{' -> '.join(chain + [base])}")
            chain.append(base)


def check_table(data, software: dict, networks: dict) -> None:
    """Every row of a table of the right shape (`software` and `networks`: the presets its rows may name)."""
    check_presets(software)
    for i, row in enumerate(data["runs"]):
        check_row(row, software, networks, f"run {i + 1}")
    ids = [row["id"] for row in data["runs"]]
    if len(set(ids)) != len(ids):
        raise PublishedRunError(f"published run ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")


def check_row(row, software: dict, networks: dict, where: str) -> None:
    if not isinstance(row, dict):
        raise PublishedRunError(f"{where}: a run is a JSON object, not {type(row).__name__}")
    where = f"run {row['id']!r}" if "id" in row else where
    _keys(row, REQUIRED, REQUIRED + OPTIONAL, where)
    _keys(row["model"], ("seq",), MODEL, f"{where} model")
    if "registry" not in row["model"]:
        _keys(row["model"], MODEL_SIZES, MODEL, f"{where} model (no registry name)")
        if row["model"].get("family") not in FAMILIES:
            raise PublishedRunError(f"{where} model: family {row['model'].get('family')!r} is not one of "
                                    f"{', '.join(FAMILIES)} (or give a registry name)")
    _keys(row["layout"], ("micro_batch", "global_batch"), LAYOUT, f"{where} layout")
    _layout(row["layout"], where)
    measured = row["measured"]
    _keys(measured, ("unit", "value"), ("unit", "value"), f"{where} measured")
    if measured["unit"] not in UNITS:
        raise PublishedRunError(f"{where} measured: unit {measured['unit']!r} is not one of {', '.join(UNITS)}")
    if not _positive(measured["value"]):
        raise PublishedRunError(f"{where} measured: value {measured['value']!r} is not a positive number")
    if not _whole(row["gpus"]):
        raise PublishedRunError(f"{where}: gpus {row['gpus']!r} is not a positive whole number")
    if row.get("network") is not None and row["network"] not in networks:
        raise PublishedRunError(f"{where}: network {row['network']!r} is none of {sorted(networks)}")
    _software(row.get("software", {}), software, f"{where} software")


def _layout(layout: dict, where: str) -> None:
    degrees = {k: layout.get(k, 1) for k in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "virtual_stages")}
    for name, value in {**degrees, "global_batch": layout["global_batch"]}.items():
        if not _whole(value):
            raise PublishedRunError(f"{where} layout: {name} {value!r} is not a positive whole number")
    if layout.get("balance", "layers") not in ("layers", "model"):
        raise PublishedRunError(f"{where} layout: balance {layout['balance']!r} is not 'layers' (as many layers a "
                                f"stage) or 'model' (the model's own split)")
    per_step = degrees["dp"] * degrees["micro_batch"]
    if layout["global_batch"] % per_step:
        raise PublishedRunError(f"{where} layout: global_batch {layout['global_batch']} is not a whole number of "
                                f"micro-batches: dp {degrees['dp']} x micro_batch {degrees['micro_batch']} = "
                                f"{per_step} sequences a micro-batch step")


def _software(spec: dict, software: dict, where: str, keys=("base",)) -> None:
    """A run's software or a preset: a base that is a preset (or colozoo), and besides `keys` Software's fields."""
    base = spec.get("base", "colozoo")
    if base != "colozoo" and base not in software:
        raise PublishedRunError(f"{where}: base {base!r} is none of {sorted(software) + ['colozoo']}")
    unknown = sorted(set(spec) - {f.name for f in fields(Software)} - set(keys))
    if unknown:
        raise PublishedRunError(f"{where}: {unknown} are no fields of colozoo.cost.software.Software")


def _keys(obj, required, allowed, where: str) -> None:
    if not isinstance(obj, dict):
        raise PublishedRunError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise PublishedRunError(f"{where}: missing {missing}")
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise PublishedRunError(f"{where}: unknown keys {unknown}; the keys a run may give: {', '.join(allowed)}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
