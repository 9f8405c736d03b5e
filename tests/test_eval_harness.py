"""lm-evaluation-harness on colozoo models against the harness's own HF backend (`lm_eval --model hf`) on the same
checkpoints: tiny LLaMA, GPT-2 and Qwen3 models of 32 positions (so few-shot prompts and long documents are
left-truncated and perplexity runs over several rolling windows), the shipped tasks, and `stop_gen` (the shipped
generation task with stop sequences a random model meets: "e", "\\n" and "."). Every metric and every response
agree: accuracy, exact match and the generated text identical, log-likelihoods to 1e-4; at tp=1 through the Python
API (a model object, and by name), and through `colozoo eval` at tp=1, tp=2, pp=2, tp2 x pp2 and dp=2."""
import json
import sys
from pathlib import Path

import pytest
import torch

from colozoo import cli
from distributed import run_distributed
from eval_model import make_eval_model

SHIPPED_DATA = Path(__file__).resolve().parent.parent / "colozoo" / "evaluation" / "tasks" / "data"
TASKS = ["colozoo_mc", "colozoo_ppl", "stop_gen"]
FEWSHOT, LIMIT, BATCH = 1, 8, 4
EXACT = ("acc", "acc_norm", "exact_match")
STOP_GEN = """include: {shipped}
task: stop_gen
generation_kwargs:
  until: ["e", "\\n", "."]
  max_gen_toks: 8
  do_sample: false
"""


@pytest.fixture(scope="module", autouse=True)
def no_environment_info():
    """The harness describes the machine in its results (torch's collect_env runs `pip list`: 2 s a run); the
    comparisons do not read it."""
    import lm_eval.evaluator

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    """The models, a folder holding stop_gen, and the HF backend's results on each model."""
    import lm_eval

    from colozoo.evaluation.run import SHIPPED_TASKS, task_manager

    root = tmp_path_factory.mktemp("eval")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "stop_gen.yaml").write_text(STOP_GEN.format(shipped=SHIPPED_TASKS / "colozoo_gen.yaml"))
    manager = task_manager(str(tasks), names=TASKS)
    models, reference = {}, {}
    for family in ("llama", "gpt2", "qwen3"):
        models[family] = make_eval_model(root / family, family, positions=32)
        reference[family] = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={models[family]},dtype=float32", device="cpu", tasks=TASKS,
            task_manager=manager, batch_size=BATCH, num_fewshot=FEWSHOT, limit=LIMIT, log_samples=True)
    return {"root": root, "tasks": tasks, "manager": manager, "models": models, "reference": reference}


def responses(results, task) -> list:
    """Each request's response, flat: a log-likelihood, whether it is greedy, or the generated text."""
    flat = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        for response in sample["resps"]:
            flat += list(response[0]) if isinstance(response[0], (list, tuple)) else [response[0]]
    return flat


def assert_same_results(ours, theirs):
    assert ours["results"].keys() == theirs["results"].keys()
    for task, metrics in theirs["results"].items():
        for key, value in metrics.items():
            if "stderr" in key or not isinstance(value, float):
                continue
            if key.split(",")[0] in EXACT:
                assert ours["results"][task][key] == value, (task, key)
            else:
                torch.testing.assert_close(ours["results"][task][key], value, rtol=1e-4, atol=0, msg=(task, key))
        mine, peer = responses(ours, task), responses(theirs, task)
        assert len(mine) == len(peer) and [type(v) for v in mine] == [type(v) for v in peer], task
        for a, b in zip(mine, peer):
            if isinstance(b, float):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4, msg=task)
            else:
                assert a == b, task


def test_the_checks_below_cover_truncation_rolling_windows_and_stops(setup):
    """The reference runs have what the comparisons must cover: requests longer than the context, documents over
    several windows, generations cut by a stop sequence, and stop-free ones too."""
    from transformers import AutoTokenizer

    reference = setup["reference"]["llama"]
    tokenizer = AutoTokenizer.from_pretrained(str(setup["models"]["llama"]))
    contexts = [s["arguments"][0][0] for s in reference["samples"]["colozoo_mc"]]
    assert max(len(tokenizer(c).input_ids) for c in contexts) > 32
    documents = [s["doc"]["text"] for s in reference["samples"]["colozoo_ppl"]]
    assert max(len(tokenizer(d).input_ids) for d in documents) > 32
    for family in setup["models"]:
        texts = responses(setup["reference"][family], "stop_gen")
        assert len(set(texts)) > 3
        assert any(len(t) < 8 for t in texts)  # stopped before 8 tokens of at least one character


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_python_api_matches_the_hf_backend(setup, family):
    """A model object wrapped in ColozooLM, or the backend by name as `lm_eval --model colozoo` builds it."""
    from lm_eval.api.registry import get_model

    from colozoo.api import from_pretrained
    from colozoo.evaluation import ColozooLM, evaluate
    from colozoo.evaluation.run import load_tasks

    if family == "gpt2":
        lm = ColozooLM(from_pretrained(setup["models"][family]), batch_size=BATCH)
    else:
        lm = get_model("colozoo").create_from_arg_string(f"pretrained={setup['models'][family]}",
                                                         {"batch_size": BATCH, "device": "cpu"})
    ours = evaluate(lm, load_tasks(TASKS, setup["manager"]), setup["manager"], num_fewshot=FEWSHOT, limit=LIMIT,
                    log_samples=True)
    assert_same_results(ours, setup["reference"][family])
    assert ours["colozoo"]["tokens"] > 0 and ours["colozoo"]["tokens_per_s"] > 0


def token_requests(model_dir) -> list:
    """Token-level loglikelihood requests whose continuation is, or is not, the greedy choice: a context's most and
    least likely next token (one row of the backend's logits cache serves both), and its own last tokens; contexts
    past the 32 positions too."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    texts = [json.loads(line)["text"] for line in (SHIPPED_DATA / "ppl_test.jsonl").read_text().splitlines()]
    requests = []
    for i, text in enumerate(texts[:6]):
        ids = tokenizer(text).input_ids[: 12 + 6 * i]
        with torch.no_grad():
            logits = model(torch.tensor([ids[-32:]])).logits[0, -1]
        requests += [(None, ids, [int(logits.argmax())]), (None, ids, [int(logits.argmin())]),
                     (None, ids[:-3], ids[-3:])]
    return requests


def test_token_requests_score_as_the_hf_backend(setup):
    """Log-likelihoods and greedy flags, true and false, from the HF backend's own _loglikelihood_tokens."""
    from lm_eval.models.huggingface import HFLM

    from colozoo.api import from_pretrained
    from colozoo.evaluation import ColozooLM

    requests = token_requests(setup["models"]["llama"])
    peer = HFLM(pretrained=str(setup["models"]["llama"]), device="cpu", dtype="float32", batch_size=BATCH)
    expected = peer._loglikelihood_tokens(requests)
    assert {greedy for _, greedy in expected} == {True, False}
    ours = ColozooLM(from_pretrained(setup["models"]["llama"]), batch_size=BATCH)._loglikelihood_tokens(requests)
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in expected]
    torch.testing.assert_close([ll for ll, _ in ours], [ll for ll, _ in expected], rtol=1e-5, atol=1e-4)


def token_scores_on_ranks(model_dir, requests, tp, pp):
    from colozoo.api import from_pretrained
    from colozoo.evaluation import ColozooLM

    return ColozooLM(from_pretrained(model_dir, tp=tp, pp=pp), batch_size=BATCH)._loglikelihood_tokens(requests)


def eval_argv(setup, family, output, *mesh):
    root = setup["root"]
    return ["eval", str(root / family), "--tasks", ",".join(TASKS), "--include-path", str(root / "tasks"),
            "--num-fewshot", str(FEWSHOT), "--limit", str(LIMIT), "--batch-size", str(BATCH), "--output", str(output),
            "--log-samples", *mesh]


def test_colozoo_eval_matches_the_hf_backend_at_tp1(setup, tmp_path, capsys):
    assert cli.main(eval_argv(setup, "llama", tmp_path / "results.json")) == 0
    out = capsys.readouterr().out
    assert "|colozoo_mc |" in out and "acc_norm" in out and "tokens/s" in out
    ours = json.loads((tmp_path / "results.json").read_text())
    assert_same_results(ours, setup["reference"]["llama"])
    assert ours["colozoo"]["seconds"] > 0 and ours["config"]["mesh"] == {"tp": 1, "pp": 1, "dp": 1}


def colozoo_eval_on_ranks(argv):
    """`colozoo eval` on every rank of the pool; rank 0's results JSON."""
    from pathlib import Path

    import lm_eval.evaluator

    with pytest.MonkeyPatch.context() as patch:  # as no_environment_info does in the test process
        patch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
        assert cli.main(argv) == 0
    output = Path(argv[argv.index("--output") + 1])
    return json.loads(output.read_text()) if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("family,tp,pp,dp", [("llama", 2, 1, 1), ("gpt2", 1, 2, 1), ("qwen3", 2, 2, 1),
                                             ("gpt2", 1, 1, 2)])
def test_colozoo_eval_on_a_mesh_matches_the_hf_backend(setup, tmp_path, family, tp, pp, dp):
    """dp > 1: the ranks beyond tp x pp are replicas, each scoring a share of the requests."""
    argv = eval_argv(setup, family, tmp_path / "results.json", "--tp", str(tp), "--pp", str(pp))
    ours = run_distributed(colozoo_eval_on_ranks, tp * pp * dp, argv, timeout=240)[0]
    assert ours["config"]["mesh"] == {"tp": tp, "pp": pp, "dp": dp}
    assert_same_results(ours, setup["reference"][family])
    if tp > 1:  # greedy flags, true and false, from the vocabulary slices
        from lm_eval.models.huggingface import HFLM

        requests = token_requests(setup["models"][family])
        peer = HFLM(pretrained=str(setup["models"][family]), device="cpu", dtype="float32", batch_size=BATCH)
        expected = peer._loglikelihood_tokens(requests)
        for scores in run_distributed(token_scores_on_ranks, tp * pp, str(setup["models"][family]), requests, tp=tp,
                                      pp=pp, timeout=120):
            assert [greedy for _, greedy in scores] == [greedy for _, greedy in expected]
            torch.testing.assert_close([ll for ll, _ in scores], [ll for ll, _ in expected], rtol=1e-5, atol=1e-4)


def test_sampling_as_the_task_asks(setup):
    """do_sample with a temperature samples (other text than greedy, another with another seed); temperature 0
    without do_sample is greedy, as in the HF backend."""
    from lm_eval.api.instance import Instance

    from colozoo.api import from_pretrained
    from colozoo.evaluation import ColozooLM

    lm = ColozooLM(from_pretrained(setup["models"]["qwen3"]), batch_size=BATCH)
    prompts = [s["arguments"][0][0] for s in setup["reference"]["qwen3"]["samples"]["stop_gen"]]

    def generate(**options):
        kwargs = {"until": ["\n"], "max_gen_toks": 8, **options}
        return lm.generate_until([Instance("generate_until", {}, (p, dict(kwargs)), i) for i, p in enumerate(prompts)])

    greedy = generate(temperature=0.0)
    assert generate() == greedy
    torch.manual_seed(0)
    sampled = generate(do_sample=True, temperature=2.0)
    torch.manual_seed(1)
    assert sampled != greedy and generate(do_sample=True, temperature=2.0) != sampled


def test_without_lm_eval_colozoo_eval_says_what_to_install(setup, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert cli.main(["eval", str(setup["models"]["gpt2"]), "--tasks", "colozoo_mc"]) == 1
    err = capfd.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'colozoo[eval]'" in err, err


def test_finetune_scores_the_tasks_beside_the_eval_loss(setup, tmp_path):
    """At every evaluation and at the end; before training the scores are the HF backend's on the checkpoint."""
    import lm_eval

    from colozoo.finetune.config import FinetuneConfig
    from colozoo.finetune.loop import finetune
    from colozoo.finetune.metrics import read_metrics

    model, tasks = setup["models"]["gpt2"], ["colozoo_mc", "colozoo_ppl"]
    finetune(FinetuneConfig(model=str(model), data=str(write_stories(tmp_path / "stories.jsonl")),
                            output=str(tmp_path / "run"), seq_len=32, steps=2, eval_interval=1, samples=0,
                            progress=False, plot=False, export_hf=False, eval_tasks=",".join(tasks),
                            eval_tasks_limit=LIMIT, micro_batch_size=BATCH))
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all("colozoo_mc/acc" in r and "colozoo_ppl/word_perplexity" in r for r in records)
    peer = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32", device="cpu",
                                   tasks=tasks, task_manager=setup["manager"], batch_size=BATCH, limit=LIMIT)
    for task, metrics in peer["results"].items():
        for key, value in metrics.items():
            metric, _, where = key.partition(",")
            if where == "none" and "_stderr" not in metric and isinstance(value, float):
                torch.testing.assert_close(records[0][f"{task}/{metric}"], value, rtol=1e-4, atol=0)
    assert records[-1]["colozoo_ppl/word_perplexity"] != records[0]["colozoo_ppl/word_perplexity"]


def write_stories(path):
    from colozoo.demo_finetune import texts

    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts()[:64]))
    return path
