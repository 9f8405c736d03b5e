"""Reward functions named on the command line find the modules beside them, as `python -m module` (the working
directory) or `python file.py` (the file's directory) would, when imported and when called (a lazy import), while
the process's own imports afterwards do not find the user's files first."""
import os
import sys
import textwrap

import pytest

from colozoo.finetune.rewards import RewardFunctions


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def bare_path(monkeypatch):
    """sys.path as the `colozoo` console script has it: without the working directory."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    return list(sys.path)


def rewards_of(spec: str):
    rewards, _, _ = RewardFunctions([spec], (1.0,))(["p"], ["abc", "de"], [[1], [2]], {}, step=1, total_steps=2)
    return rewards[:, 0].tolist()


@pytest.mark.parametrize("lazy", [True, False])
def test_a_module_reward_imports_the_module_beside_it(lazy, tmp_path, monkeypatch, bare_path):
    sibling = f"cz_reward_sibling_module_{lazy}"
    write(tmp_path / f"{sibling}.py", "def score(text):\n    return float(len(text))\n")
    body = f"    from {sibling} import score\n" if lazy else ""
    write(tmp_path / f"cz_reward_module_{lazy}.py",
          ("" if lazy else f"from {sibling} import score\n") +
          f"def length(completions, **kwargs):\n{body}    return [score(c) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    assert rewards_of(f"cz_reward_module_{lazy}:length") == [3.0, 2.0]
    assert sys.path == bare_path


@pytest.mark.parametrize("lazy", [True, False])
def test_a_file_reward_imports_the_module_beside_it(lazy, tmp_path, bare_path):
    sibling = f"cz_reward_sibling_file_{lazy}"
    write(tmp_path / "rewards" / f"{sibling}.py", "def score(text):\n    return 2.0\n")
    body = f"    from {sibling} import score\n" if lazy else ""
    write(tmp_path / "rewards" / "mine.py",
          ("" if lazy else f"from {sibling} import score\n") +
          f"def two(completions, **kwargs):\n{body}    return [score(c) for c in completions]\n")
    assert rewards_of(f"{tmp_path / 'rewards' / 'mine.py'}:two") == [2.0, 2.0]
    assert sys.path == bare_path
