"""The log-likelihood scoring of evaluation (colozoo.evaluation.scoring) on a tiny LLaMA: each row's logits are
projected at its own positions only, and the scores equal those of a whole forward's log-softmax."""
import torch
from family_cases import tiny_config

from colozoo.api import build_model
from colozoo.core.mesh import single_process
from colozoo.evaluation.scoring import Span, score_spans
from colozoo.layers.vocab import VocabParallelLMHead


def test_each_row_projects_only_its_own_positions_and_scores_as_a_whole_forward(monkeypatch):
    config = tiny_config("llama")
    torch.manual_seed(0)
    model = build_model(config, parallel=single_process()).eval()
    ids = torch.randint(0, config.vocab_size, (3, 24))
    targets = torch.randint(0, config.vocab_size, (3, 24)).tolist()
    # row 0 one long continuation (positions 4..23), row 1 two short ones, row 2 the first two positions
    spans = [Span(0, 24, tuple(targets[0][4:24])), Span(1, 8, tuple(targets[1][6:8])), Span(1, 12, (targets[1][11],)),
             Span(2, 2, tuple(targets[2][0:2]))]
    projected, head = [], VocabParallelLMHead.forward
    monkeypatch.setattr(VocabParallelLMHead, "forward",
                        lambda self, hidden, *a, **k: projected.append(tuple(hidden.shape[:2])) or head(self, hidden,
                                                                                                        *a, **k))
    scores = score_spans(model, ids, spans)
    assert projected == [(3, 20)]  # the longest row's 20 positions, not the union's 22
    monkeypatch.undo()
    with torch.no_grad():
        logps = torch.log_softmax(model(ids).logits.double(), -1)
    for span, (logp, greedy) in zip(spans, scores):
        at = range(span.end - len(span.tokens), span.end)
        expected = sum(logps[span.row, p, t] for p, t in zip(at, span.tokens))
        torch.testing.assert_close(torch.tensor(logp, dtype=torch.float64), expected, rtol=1e-5, atol=1e-5)
        assert greedy == all(int(logps[span.row, p].argmax()) == t for p, t in zip(at, span.tokens))
