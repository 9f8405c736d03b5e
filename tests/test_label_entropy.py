"""The entropy metric of a step on per-token log-probabilities (GRPO's "entropy") comes out of the pass that computes
the log-probs: the same log-probs and gradients bit for bit, the entropy equal to label_entropy's and to TRL's
(entropy_from_logits of logits / temperature at each labelled position), at tp 1, tp 2 and cp 2, and the fp32
temporaries of one vocab slice's softmax made once, not twice."""
import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed

from colozoo.layers.vocab import VocabParallelLMHead
from colozoo.runtime.logprobs import ObjectiveStep

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, TEMPERATURE = 37, 0.7  # 37: padded to 38 over two tp ranks
RTOL, ATOL = 1e-6, 1e-5  # fp32: the entropy's statistics are summed in another order than label_entropy's


def batch(tokens: int = 8, vocab: int = VOCAB, seed: int = 0):
    """(logits (2, tokens, vocab), labels with ignored positions) on the whole vocabulary and sequence."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (2, tokens), generator=g)
    labels[0, :3] = labels[1, 5] = -100
    return torch.randn(2, tokens, vocab, generator=g) * 3, labels


def trl_entropy(logits, labels):
    """TRL's entropy of each position's softmax, laid out like the labels (position t: the distribution that predicts
    labels[t]; 0 where unlabelled)."""
    from trl.trainer.utils import entropy_from_logits

    return F.pad(entropy_from_logits(logits)[..., :-1], (1, 0)).masked_fill(labels == -100, 0.0)


def objective_step(logits, labels, head, cp=None, entropy=True):
    """(loss, the objective's log-probs, its rows["entropy"]) of ObjectiveStep.objective_loss at TEMPERATURE."""
    seen = {}

    def objective(logps, labels, rows):
        seen.update(logps=logps, entropy=rows.get("entropy"))
        weights = torch.linspace(0.5, 1.5, logps.numel()).view_as(logps)
        return (logps * weights).sum(), {}

    step = ObjectiveStep(objective, {}, replicas=1, temperature=TEMPERATURE, entropy=entropy)
    loss = step.objective_loss(head, logits, labels, torch.arange(labels.shape[0]), cp=cp)
    return loss, seen["logps"], seen["entropy"]


def log_probs_alone(logits, labels, head, cp=None):
    """(loss, log-probs) as the step computed them without the entropy: label_log_probs alone."""
    loss, logps, _ = objective_step(logits, labels, head, cp, entropy=False)
    return loss, logps


def check_step(logits, labels, head, cp=None, full_logits=None) -> None:
    """The step's log-probs, gradients and entropy on this rank against label_log_probs, label_entropy and TRL."""
    leaf = logits.clone().requires_grad_()
    loss, logps, entropy = objective_step(leaf, labels, head, cp)
    (grad,) = torch.autograd.grad(loss, leaf)
    alone = logits.clone().requires_grad_()
    expected_loss, expected_logps = log_probs_alone(alone, labels, head, cp)
    (expected_grad,) = torch.autograd.grad(expected_loss, alone)
    assert torch.equal(logps, expected_logps) and torch.equal(grad, expected_grad)
    assert not entropy.requires_grad
    torch.testing.assert_close(entropy, head.label_entropy(logits / TEMPERATURE, labels, cp=cp), rtol=RTOL, atol=ATOL)
    full = logits if full_logits is None else full_logits
    torch.testing.assert_close(entropy, trl_entropy(full / TEMPERATURE, labels), rtol=RTOL, atol=ATOL)


def test_entropy_of_the_log_probs_pass_at_tp1():
    logits, labels = batch()
    check_step(logits, labels, VocabParallelLMHead(4, VOCAB))


def _tp2_and_cp2_task():
    """On two ranks: tp 2 (this rank's padded vocab slice) and cp 2 (this rank's zigzag share of the sequence)."""
    import torch.distributed as dist

    from colozoo.core.groups import vocab_range
    from colozoo.layers.context_parallel import ContextParallel

    group = dist.group.WORLD
    logits, labels = batch()
    start, stop, local = vocab_range(VOCAB, group)
    sliced = torch.zeros(*logits.shape[:-1], local)
    sliced[..., : stop - start] = logits[..., start:stop]
    check_step(sliced, labels, VocabParallelLMHead(4, VOCAB, group=group), full_logits=logits)
    cp = ContextParallel(group, "ring", labels.shape[1], None)
    check_step(cp.shard(logits), labels, VocabParallelLMHead(4, VOCAB), cp=cp, full_logits=logits)
    return True


def test_entropy_of_the_log_probs_pass_at_tp2_and_cp2():
    assert run_distributed(_tp2_and_cp2_task, 2, timeout=90) == [True, True]


def test_softmax_of_the_vocab_slice_is_made_once(monkeypatch):
    """The fp32 tensors alive at once while the step makes its log-probs and entropy, in vocab slices: the logits over
    the temperature, the log-softmax kept for the backward and one chunk of rows (here an eighth of them) for the
    entropy's sum. Two passes (label_log_probs, then label_entropy) made a second log-softmax, its exp and their
    product besides (5 slices); the entropy's sum over the whole slice at once makes one more (3)."""
    from live_bytes import LiveBytes

    from colozoo.kernels import head_loss

    logits, labels = batch(tokens=64, vocab=512)
    logits.requires_grad_()
    monkeypatch.setattr(head_loss, "ROW_SUM_ELEMENTS", logits.numel() // 8)
    with LiveBytes() as counted:
        objective_step(logits, labels, VocabParallelLMHead(4, 512))
    slice_bytes = logits.numel() * 4
    assert counted.peak <= 2.5 * slice_bytes, f"{counted.peak / slice_bytes:.2f} vocab slices of fp32 at once"
