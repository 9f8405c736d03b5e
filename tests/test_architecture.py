"""The architecture holds: imports flow one way (core <- kernels <- layers <- models <- converters/registry <-
runtime <- checkpoint/cost <- api, cli, finetune, demos), with no cycle, counting imports inside functions and
names re-exported by a package's __init__; and no file in colozoo/ is over 450 lines."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each module's level is that of the longest prefix listed here; a module may import only from its own level or
# below (modules of one level may import each other, cycles aside).
LEVELS = {
    "colozoo.core": 0,
    "colozoo.kernels": 1,
    "colozoo.layers": 2,
    "colozoo.models": 3,
    "colozoo.converters": 4,
    "colozoo.registry": 4,
    "colozoo.runtime": 5,
    "colozoo.checkpoint": 6,
    "colozoo.cost": 6,
    "colozoo.api": 7,
    "colozoo.finetune": 8,
    "colozoo.evaluation": 8,
    "colozoo.eval_cli": 8,
    "colozoo.generate_cli": 8,
    "colozoo.generate_stream": 8,
    "colozoo.convert_cli": 8,
    "colozoo.cli": 9,
    "colozoo.demo": 9,
    "colozoo.demo_finetune": 9,
    "colozoo": 10,  # the package's own __init__: lazy names only
}
# Siblings of one level that must not import each other.
APART = [("colozoo.checkpoint", "colozoo.cost")]
MAX_LINES = 450


def modules() -> dict[str, Path]:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in table.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def imported(module: str, path: Path) -> set[str]:
    """The project modules `module` imports, anywhere in its body, following names through packages."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    edges = {m: imported(m, p) for m, p in MODULES.items()}
    # an import of a package stands for what its __init__ imports (re-exports are followed)
    for _ in range(len(edges)):
        changed = False
        for m, targets in edges.items():
            for t in list(targets):
                if MODULES[t].name == "__init__.py" and t != "colozoo" and not m.startswith(t + "."):
                    extra = edges[t] - targets - {m}
                    if extra:
                        targets |= extra
                        changed = True
        if not changed:
            break
    return edges


def level(module: str) -> tuple[str, int]:
    key = max((k for k in LEVELS if module == k or module.startswith(k + ".")), key=len)
    return key, LEVELS[key]


def test_every_module_has_a_level():
    assert all(level(m) for m in MODULES)


def test_imports_flow_one_way():
    wrong = []
    for m, targets in graph().items():
        if m == "colozoo":
            continue
        mine, rank = level(m)
        for t in sorted(targets):
            theirs, other = level(t)
            if other > rank or (mine, theirs) in APART or (theirs, mine) in APART:
                wrong.append(f"{m} ({mine}) imports {t} ({theirs})")
    assert not wrong, "imports against the one direction:\n" + "\n".join(wrong)


def test_no_import_cycles():
    edges = graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_files_stay_short():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_models_know_only_layers():
    """A model file imports nothing of pipelines, training, checkpoints or files."""
    for m, targets in graph().items():
        if m.startswith("colozoo.models"):
            assert all(level(t)[1] <= LEVELS["colozoo.models"] for t in targets), (m, targets)


def test_every_benchmark_has_a_row_in_the_bench_readme():
    readme = (ROOT / "bench" / "README.md").read_text()
    benches = [p.name for p in (ROOT / "bench").glob("*.py")
               if not p.name.startswith("_") and p.name != "run_benchmarks.py"]
    assert benches and [b for b in benches if f"| `{b}` |" not in readme] == []


# ---------------------------------------------------------------- kernels: layers call only the ops

KERNELS = "colozoo.kernels"
PENDING_DISPATCH: set[str] = set()  # modules allowed to reach past the ops for a while (none now)


def _in_kernels(module: str) -> bool:
    return module == KERNELS or module.startswith(KERNELS + ".")


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _imported_names(module: str, path: Path, body) -> list[str]:
    """Every module or name the statements import, absolute and dotted ("colozoo.kernels.dispatch.use_triton")."""
    names = []
    for node in body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path, node)
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def _module_level(tree: ast.Module):
    """The statements that run when the module is imported: the body, through if / try / with blocks."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                pending += getattr(node, field, [])
        elif isinstance(node, ast.ExceptHandler):
            pending += node.body


def _kernel_policy_uses(module: str, path: Path) -> list[str]:
    """Where `module` reaches past the ops: imports kernels.dispatch or a Triton module, or names use_triton."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for name in _imported_names(module, path, ast.walk(tree)):
        if (name.startswith(f"{KERNELS}.dispatch") or name.split(".")[-1] == "use_triton"
                or (name.startswith(KERNELS + ".") and name.split(".")[2].endswith("_triton"))
                or name.split(".")[0] == "triton"):
            found.append(f"imports {name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Name) and node.id == "use_triton") or (
                isinstance(node, ast.Attribute) and node.attr == "use_triton"):
            found.append(f"line {node.lineno}: use_triton")
    return sorted(set(found))


def test_only_kernels_pick_triton_or_torch():
    """Outside kernels/ nothing imports kernels.dispatch or a Triton module, or calls use_triton: layers call the ops
    (the mode switches set_kernels / use_kernels come from colozoo.kernels)."""
    wrong = {m: uses for m, p in MODULES.items() if not _in_kernels(m) and m not in PENDING_DISPATCH
             and (uses := _kernel_policy_uses(m, p))}
    assert not wrong, f"kernel dispatch outside colozoo.kernels: {wrong}"
    stale = [m for m in sorted(PENDING_DISPATCH) if not _kernel_policy_uses(m, MODULES[m])]
    assert not stale, f"no longer reach past the ops, drop them from PENDING_DISPATCH: {stale}"


def test_op_modules_import_no_triton():
    """An op module (colozoo.kernels.<op>) imports triton, or an <op>_triton module, only inside the op that runs
    the kernel: triton decides at decoration time whether to interpret, so kernels load only when used."""
    wrong = {}
    for m, p in MODULES.items():
        if not _in_kernels(m) or m.rpartition(".")[2].endswith("_triton"):
            continue
        tree = ast.parse(p.read_text(), str(p))
        triton = [n for n in _imported_names(m, p, _module_level(tree))
                  if n.split(".")[0] == "triton" or (n.startswith(KERNELS + ".") and n.split(".")[2].endswith("_triton"))]
        if triton:
            wrong[m] = triton
    assert not wrong, f"op modules importing triton at module level: {wrong}"


def test_tests_stay_short_and_their_helpers_sit_apart():
    """Test files hold tests (test_*.py, conftest.py); what they share lives in tests/helpers; every file of either
    keeps to the 450 lines of the code it tests."""
    tests = ROOT / "tests"
    stray = [p.name for p in tests.glob("*.py") if not p.name.startswith("test_") and p.name != "conftest.py"]
    assert not stray, f"helpers among the test files (move them to tests/helpers): {stray}"
    long = {str(p.relative_to(ROOT)): n for p in tests.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"test files over {MAX_LINES} lines: {long}"


# --- each family's vocabulary in its own files ------------------------------------------------------------------
# A family's config keys are those of its transformers config class: the ones at most FEW families' classes have are
# their own vocabulary (n_inner, ffn_dim, kv_lora_rank, moe_intermediate_size, ...), spelled only in their model and
# converter modules; the others are the vocabulary every shared layer reads (hidden_size, sliding_window, head_dim,
# num_experts_per_tok, ...). A module spells a key by reading it off a config (`config.key`, `getattr(c, "key")`, any
# string "key") or by passing it to a config class.
FEW = 3
COMMON = {"dropout": "a word of every layer's arguments (OPT's config key too)",
          "original_max_position_embeddings": "RoPE's: any family's rope_parameters may hold it"}
PENDING_VOCABULARY = {"colozoo.cost.planner": {"num_local_experts"}}  # its expert-count guess, to read the hook


def family_vocabulary() -> dict[str, set[str]]:
    """Config key -> the families whose config class has it, for the keys at most FEW families share."""
    import inspect

    import transformers

    from colozoo.models import families

    generic = set(inspect.signature(transformers.PretrainedConfig.__init__).parameters)
    generic |= set(transformers.PretrainedConfig().to_dict()) | {"self", "kwargs"}
    owners: dict[str, set[str]] = {}
    for family in set(families().values()):
        cls = type(transformers.AutoConfig.for_model(family.model_types[0]))
        for key in (set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {}))) - generic:
            owners.setdefault(key, set()).add(family.name)
    return {key: names for key, names in owners.items() if len(names) <= FEW and key not in COMMON}


def family_files(name: str) -> set[str]:
    """The modules of a family: the model file declaring it and the converter declaring its class."""
    from colozoo.converters import family_module
    from colozoo.models import family_of

    return {family_of(name).model.__module__, family_module(name).__name__}


def _reads_config(node) -> bool:
    return ((isinstance(node, ast.Name) and (node.id in ("c", "cfg") or node.id.endswith("config")))
            or (isinstance(node, ast.Attribute) and node.attr.endswith("config")))


def spelled_keys(path: Path) -> dict[str, list[int]]:
    """Every name the module reads off a config, writes as a string or passes to a config class, with its lines."""
    out: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Attribute) and _reads_config(node.value):
            names = [node.attr]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        elif isinstance(node, ast.Call) and (getattr(node.func, "id", "") or getattr(node.func, "attr", "")).endswith(
                ("Config", "for_model")):
            names = [k.arg for k in node.keywords if k.arg]
        for name in names:
            out.setdefault(name, []).append(node.lineno)
    return out


def test_family_config_keys_are_spelled_only_in_their_familys_files():
    vocabulary = family_vocabulary()
    assert {"n_inner", "ffn_dim", "kv_lora_rank", "first_k_dense_replace", "moe_intermediate_size"} <= set(vocabulary)
    stray = []
    for module, path in MODULES.items():
        for key, lines in spelled_keys(path).items():
            owners = vocabulary.get(key)
            if owners and key not in PENDING_VOCABULARY.get(module, ()) and module not in set().union(
                    *(family_files(name) for name in owners)):
                stray.append(f"{module} (line {lines[0]}) spells {key!r}, a config key of {sorted(owners)} only")
    assert not stray, ("read these through a hook of the family's model class (models/base.py lists them):\n"
                       + "\n".join(stray))


def test_every_family_declares_a_tiny_config_and_a_converter_importing_its_model():
    """Beside its FAMILIES entry the config its tests build; a converter module found by its CONVERTS, whose imports
    (this file's graph) hold the family's model module."""
    from colozoo.converters import family_module
    from colozoo.models import families

    for family in set(families().values()):
        assert family.tiny is not None and family.tiny.config, f"{family.name} declares no tiny config"
        converter = family_module(family.name).__name__
        assert family.model.__module__ in imported(converter, MODULES[converter]), (family.name, converter)
