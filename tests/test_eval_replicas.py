"""lm-eval requests dealt over the dp replicas (colozoo.evaluation.replicas): on a tiny LLaMA of 32 positions at dp=2,
dp=2 x tp=2 and dp=2 x pp=2, every rank returns the answers of lm-eval's own HF backend to every loglikelihood
(greedy flags too), loglikelihood_rolling and generate_until request, while each replica's model saw only its share
(the tp and pp ranks of a replica the same share); shares of one request, or none, do not hang; a model sharded over
dp by FSDP scores every request on every replica."""
import json
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from eval_model import make_eval_model

from colozoo.evaluation.replicas import deal

DATA = Path(__file__).resolve().parent.parent / "colozoo" / "evaluation" / "tasks" / "data" / "ppl_test.jsonl"
BATCH = 2
KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def instances(n: int | None = None) -> dict:
    """Requests of each kind: two continuations of each context (one-token answers share a row of the logits
    cache), whole stories (several windows of 32 positions), prompts stopped at "." or "\\n"."""
    from lm_eval.api.instance import Instance

    texts = [json.loads(line)["text"] for line in DATA.read_text().splitlines()][:n or 6]
    pairs = [(t[: 30 + 13 * i], c) for i, t in enumerate(texts) for c in (" the", " horse went home")]
    until = {"until": ["\n", "."], "max_gen_toks": 6, "do_sample": False}
    arguments = {"loglikelihood": pairs[: n or len(pairs)], "loglikelihood_rolling": [(t,) for t in texts],
                 "generate_until": [(t[: 20 + 9 * i], dict(until)) for i, t in enumerate(texts)]}
    return {kind: [Instance(kind, {}, args, i) for i, args in enumerate(arguments[kind])] for kind in KINDS}


@pytest.fixture(scope="module")
def model(tmp_path_factory, one_thread):
    return make_eval_model(tmp_path_factory.mktemp("replicas") / "llama", "llama", positions=32)


@pytest.fixture(scope="module")
def peer(model):
    """lm-eval's HF backend's answers to the requests, all of them and the first few."""
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(model), device="cpu", dtype="float32", batch_size=BATCH)
    return {n: {kind: getattr(hf, kind)(requests) for kind, requests in instances(n).items()} for n in (None, 1, 3)}


def answers_and_counts(model_dir, n, tp=1, pp=1, fsdp=False):
    """Every kind's answers on this rank, and the requests its model scored: token requests (rolling windows for
    loglikelihood_rolling) and generated rows. `fsdp`: the model sharded over dp, as fine-tuning holds it."""
    from colozoo.api import from_pretrained
    from colozoo.evaluation import ColozooLM
    from colozoo.runtime.parallelize import parallelize

    model = from_pretrained(model_dir, tp=tp, pp=pp)
    if fsdp:
        parallelize(model, data_parallel="fsdp")
    lm = ColozooLM(model, batch_size=BATCH, progress=False)
    counted = {"rows": 0}
    score, generate = lm._loglikelihood_tokens, lm._model_generate

    def counting_score(requests, *args, **kwargs):
        counted["rows"] += len(requests)
        return score(requests, *args, **kwargs)

    def counting_generate(context, *args, **kwargs):
        counted["rows"] += context.shape[0]
        return generate(context, *args, **kwargs)

    lm._loglikelihood_tokens, lm._model_generate = counting_score, counting_generate
    answers, counts = {}, {}
    for kind, requests in instances(n).items():
        before = counted["rows"]
        answers[kind] = getattr(lm, kind)(requests)
        counts[kind] = counted["rows"] - before
    return answers, counts, lm._model.parallel.config.dp, lm._model.parallel.rank("dp")


def assert_same_answers(ours, theirs):
    for kind in KINDS:
        mine, peer = ours[kind], theirs[kind]
        assert len(mine) == len(peer), kind
        if kind == "loglikelihood":
            assert [greedy for _, greedy in mine] == [greedy for _, greedy in peer]
            mine, peer = [ll for ll, _ in mine], [ll for ll, _ in peer]
        if kind == "generate_until":
            assert mine == peer
        else:
            torch.testing.assert_close(mine, peer, rtol=1e-5, atol=1e-4, msg=kind)


def test_deal_gives_the_longest_first_round_robin():
    assert deal([3, 9, 1, 7, 5], 2) == [[1, 4, 2], [3, 0]]
    assert deal([4], 4) == [[0], [], [], []]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_each_replica_scores_its_share_and_every_rank_gets_the_hf_backends_answers(model, peer, tp, pp):
    _, single, _, _ = answers_and_counts(str(model), None)
    ranks = run_distributed(answers_and_counts, 2 * tp * pp, str(model), None, tp=tp, pp=pp, timeout=120)
    assert {dp for _, _, dp, _ in ranks} == {2}
    for answers, _, _, _ in ranks:
        assert_same_answers(answers, peer[None])
    for kind in KINDS:
        by_replica = {}
        for _, counts, _, replica in ranks:
            assert by_replica.setdefault(replica, counts[kind]) == counts[kind], kind  # a replica's ranks alike
        assert sum(by_replica.values()) == single[kind] and 0 < min(by_replica.values()), (kind, by_replica)
        assert max(by_replica.values()) < single[kind], (kind, by_replica)


@pytest.mark.parametrize("world,n", [(2, 3), (4, 1)])
def test_fewer_requests_than_replicas_do_not_hang(model, peer, world, n):
    """dp=4 with one request of each kind: three replicas score none; dp=2 with three: one context's two
    continuations go to one replica."""
    for answers, counts, dp, _ in run_distributed(answers_and_counts, world, str(model), n, timeout=60):
        assert dp == world
        assert_same_answers(answers, peer[n])


def test_a_model_sharded_over_dp_scores_every_request_on_every_replica(model, peer):
    """FSDP gathers the parameters from every replica in each forward: the replicas cannot score apart."""
    _, single, _, _ = answers_and_counts(str(model), 3)
    for answers, counts, dp, _ in run_distributed(answers_and_counts, 2, str(model), 3, fsdp=True, timeout=60):
        assert dp == 2 and counts == single
        assert_same_answers(answers, peer[3])
