"""`colozoo finetune --method grpo` end to end on a tiny LLaMA (14 tokens) with a toy reward (the share of a
completion's words that are "cat"): 30 steps raise the mean reward at tp=1 and dp=2, TRL's metric names reach
metrics.jsonl, the completions reach completions.jsonl every --log-completions steps, and a run stopped between two
uses of a batch of rollouts (--num-iterations 2; LoRA with the KL term to its adapters-off reference) resumes
exactly, its evaluations and the PEFT adapters included."""
import json
from pathlib import Path

import grpo_parity
import pytest
from grpo_parity import make_tiny_llama

from colozoo.finetune.config import FinetuneConfig
from colozoo.finetune.loop import finetune
from colozoo.finetune.metrics import read_metrics

REWARD = f"{Path(grpo_parity.__file__)}:cat_share"
TRL_METRICS = ("reward", "reward_std", "rewards/cat_share/mean", "rewards/cat_share/std", "frac_reward_zero_std",
               "completions/mean_length", "completions/min_length", "completions/max_length",
               "completions/clipped_ratio", "completions/mean_terminated_length", "entropy", "clip_ratio/region_mean",
               "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/low_min", "clip_ratio/high_max")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: one thread is fastest, on a busy machine by far


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("grpo-tiny") / "model")


def grpo_run(model, output, **options) -> FinetuneConfig:
    settings = dict(method="grpo", reward_funcs=REWARD, num_generations=4, max_completion_length=4,
                    micro_batch_size=8, lr=3e-3, warmup_steps=2, eval_interval=0, eval_fraction=0.0,
                    save_interval=0, progress=False, plot=False, export_hf=False, log_completions=0)
    return FinetuneConfig(model=str(model), data=str(Path(model) / "prompts.jsonl"), output=str(output),
                          **{**settings, **options})


def check_reward_rises(records: list[dict]):
    rewards = [r["reward"] for r in records if "reward" in r]
    assert len(rewards) == 30
    first, last = sum(rewards[:3]) / 3, sum(rewards[-10:]) / 10
    assert last > first + 0.15, (first, last, rewards)


def test_thirty_steps_raise_the_reward_logged_under_trl_names(tiny, tmp_path):
    out = tmp_path / "run"
    finetune(grpo_run(tiny, out, steps=30, log_completions=10, reward_funcs=[grpo_parity.cat_share]))  # from Python
    assert json.loads((out / "config.json").read_text())["reward_funcs"] == "grpo_parity:cat_share"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    assert set(TRL_METRICS) <= set(records[0]), set(TRL_METRICS) - set(records[0])
    check_reward_rises(records)
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [10] * 8 + [20] * 8 + [30] * 8
    assert set(logged[0]) == {"step", "sampled_at", "prompt", "completion", "rewards", "advantage"}


def rewards_at_dp2(model, output):
    """30 steps of 4-token completions; then 2 steps of completions of up to 24 tokens, most of which end earlier,
    at other steps on each replica (whose forwards must still match: FSDP gathers the weights in each)."""
    finetune(grpo_run(model, Path(output) / "short", steps=30, dp=2, micro_batch_size=4))
    finetune(grpo_run(model, Path(output) / "long", steps=2, dp=2, micro_batch_size=4, max_completion_length=24))
    return read_metrics(Path(output) / "short" / "metrics.jsonl"), read_metrics(Path(output) / "long" / "metrics.jsonl")


def test_thirty_steps_raise_the_reward_at_dp2(tiny, tmp_path):
    from distributed import run_distributed

    (records, long), _ = run_distributed(rewards_at_dp2, 2, tiny, tmp_path, timeout=240)
    check_reward_rises(records)
    assert all(r["completions/min_length"] < r["completions/max_length"] for r in long), long


def test_stopped_run_resumes_exactly_between_two_uses_of_its_rollouts(tiny, tmp_path, monkeypatch):
    """--stop-after 3 (what Ctrl-C does at the end of a step) saves after the first use of the rollouts sampled at
    step 3; the resumed run trains step 4 on them (the checkpoint carries them) and samples what the uninterrupted
    run sampled after (the sampler's seed is the step's). The sampler is asked for the prompts of each cycle of
    --num-iterations steps once, and for nothing else."""
    import peft
    import transformers

    from colozoo.finetune.data import BatchSampler

    options = dict(steps=6, num_iterations=2, lora_r=4, lora_alpha=8, beta=0.04, save_interval=2,
                   log_completions=1, eval_fraction=0.2, eval_interval=2, eval_batches=1)
    drawn, draw = [], BatchSampler.global_indices
    monkeypatch.setattr(BatchSampler, "global_indices", lambda self, step: drawn.append(step) or draw(self, step))
    finetune(grpo_run(tiny, tmp_path / "straight", **options))
    assert drawn == [0, 1, 2]
    monkeypatch.undo()
    finetune(grpo_run(tiny, tmp_path / "stopped", stop_after=3, **options))
    checkpoint = tmp_path / "stopped" / "checkpoints" / "step-00000003"
    assert (checkpoint / "rollout.safetensors").exists()
    (tmp_path / "stopped" / "rollout.safetensors").unlink()  # the checkpoint's copy is what resumes
    finetune(grpo_run(tiny, tmp_path / "stopped", **options))
    straight, resumed = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("straight", "stopped"))
    assert [r["step"] for r in straight] == [0, 1, 2, 2, 3, 4, 4, 5, 6, 6]  # evaluations at 0, 2, 4 and 6
    assert [r["step"] for r in resumed] == [r["step"] for r in straight]
    for a, b in zip(straight, resumed):
        assert set(a) == set(b), a["step"]
        for key in a:
            if key not in ("time", "tokens_per_s", "trained_tokens_per_s", "mfu"):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)
    assert "kl" in straight[-2] and "eval_reward" in straight[-1] and "reward" not in straight[5]  # 4 reuses 3's
    logs = [(tmp_path / run / "completions.jsonl").read_text() for run in ("straight", "stopped")]
    assert logs[0] == logs[1]
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    peft.PeftModel.from_pretrained(base, str(tmp_path / "stopped" / "adapter"))  # peft loads the adapters
