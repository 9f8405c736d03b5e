"""transformers' logits_to_keep: the logits of the last n positions (an int) or of the positions a tensor indexes, as
transformers returns them, at tp 1 (the head projects only the kept positions) and at tp 2 with sequence parallelism
(the head projects the sharded sequence, the gathered logits are kept after)."""
import pytest
import torch

from distributed import run_distributed
from parity import close
from test_generate import ours_and_hf, prompts

from colozoo.core.mesh import init_parallel, single_process

KEEP = {"last": 1, "last 3": 3, "positions": torch.tensor([0, 2, 5])}


def logits_to_keep_match_transformers(tp=1):
    parallel = init_parallel(tp=tp, sequence_parallel=True) if tp > 1 else single_process()
    config, hf, model = ours_and_hf("llama", parallel)
    ids, _ = prompts(config.vocab_size, lengths=(8, 8))
    for what, keep in KEEP.items():
        with torch.no_grad():
            ours, theirs = model(ids, logits_to_keep=keep).logits, hf(ids, logits_to_keep=keep).logits
        assert ours.shape == theirs.shape, f"logits_to_keep {what}: {tuple(ours.shape)} != {tuple(theirs.shape)}"
        close(ours, theirs, 1e-5, f"logits_to_keep {what} (tp={tp})")
    return True


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_to_keep_equals_transformers(tp):
    assert logits_to_keep_match_transformers() if tp == 1 else all(
        run_distributed(logits_to_keep_match_transformers, 2, tp=2, timeout=120))
