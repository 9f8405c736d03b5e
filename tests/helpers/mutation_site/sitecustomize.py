"""Applies the switch-off audit's mutation (COLOZOO_MUTATION) in every python process a test starts: the audit
(tests/helpers/mutations.py) puts this directory first on PYTHONPATH, so python imports this file at start-up in
the pytest process and in everything it starts (gloo workers, launcher and torchrun children, CLI subprocesses).
Nothing is imported here: the mutation is applied right after the process first imports colozoo, once its own
environment is set (TRITON_INTERPRET, ...). Does nothing without COLOZOO_MUTATION."""
import importlib.abc
import importlib.util
import os
import sys

HELPERS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _ApplyAfterColozoo(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "colozoo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            if HELPERS not in sys.path:
                sys.path.append(HELPERS)
            import mutations

            mutations.apply_from_environment()

        spec.loader.exec_module = exec_module
        return spec


def _other_sitecustomize():
    """The sitecustomize this one shadows, if any, run as it would have been."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("COLOZOO_MUTATION"):
    sys.meta_path.insert(0, _ApplyAfterColozoo())
_other_sitecustomize()
