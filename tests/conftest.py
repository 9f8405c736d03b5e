import os
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if not torch.cuda.is_available():
    # triton fixes interpreted vs compiled when a kernel module is imported, which any test may do first
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests import each other
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))  # and the helpers: parity, distributed, ...

import mutations  # noqa: E402

mutations.apply_from_environment()  # COLOZOO_MUTATION: tests/helpers/mutations.py switches a feature off

import pytest  # noqa: E402
from interrupt import launched_model, straight_tp2  # noqa: E402,F401 (fixtures: one straight run for every launcher test)


@pytest.fixture(scope="module")
def one_thread():
    """Runs compared bit for bit share one thread: a busy CI machine can change how a multi-threaded BLAS splits a
    reduction, which moves a loss by one ulp between two otherwise identical runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
