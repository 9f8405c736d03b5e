"""The switch-off audit's own pieces (tests/helpers/mutations.py): a Rewrite changes one function where it is defined
and where it was imported by name, and refuses a snippet it does not find once; the CI form's rotation slots hold
every mutation once, each within the budget; every named test is one pytest collects; every patch applies to the
source as it is."""
import importlib
import sys

import pytest

import mutations
from mutation_tools import Rewrite, current


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    (tmp_path / "scratch_defines.py").write_text("def scale(x):\n    factor = 2\n    return x * factor\n")
    (tmp_path / "scratch_imports.py").write_text("from scratch_defines import scale\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("scratch_defines"), importlib.import_module("scratch_imports")
    for name in ("scratch_defines", "scratch_imports"):
        sys.modules.pop(name, None)


def test_a_rewrite_changes_the_function_where_it_is_defined_and_imported(scratch):
    defines, imports = scratch
    Rewrite("scratch_defines:scale", ("factor = 2", "factor = 3"))()
    assert defines.scale(5) == imports.scale(5) == 15
    assert defines.scale.__code__.co_firstlineno == 1  # tracebacks point at the file's own lines
    with pytest.raises(ValueError, match="occurs 0 times"):
        Rewrite("scratch_defines:scale", ("factor = 5", "factor = 4"))()
    assert current("scratch_defines:scale") is defines.scale


def test_rotation_slots_hold_every_mutation_once_within_the_budget():
    cost = {name: 10.0 + 7 * (i % 5) for i, name in enumerate(mutations.MUTATIONS)}
    cost["too long"] = 400.0
    slots = mutations.rotation_slots(cost, 100.0)
    assert sorted(n for slot in slots for n in slot) == sorted(cost)
    assert all(sum(cost[n] for n in slot) <= 100.0 or len(slot) == 1 for slot in slots)
    assert slots == mutations.rotation_slots(dict(reversed(cost.items())), 100.0)  # the same slots every time


def test_every_named_test_is_collected():
    assert mutations.uncollected([t for m in mutations.MUTATIONS.values() for t in m.tests]) == []
    assert mutations.uncollected(["tests/test_sampling.py::test_no_such_test"]) == [
        "tests/test_sampling.py::test_no_such_test"]


def test_every_patch_applies_to_todays_source():
    """A source edit that leaves a switch-off patch pointing at text no longer there fails here, in the test run,
    and not only later in the mutation step."""
    assert mutations.patches_apply(list(mutations.MUTATIONS)) == []
