"""--method grpo against TRL: for the same prompts and sampled completions, the rewards, advantages and rollout metrics
equal those TRL's GRPOTrainer computes (every --scale-rewards, --mask-truncated-completions, strings and
conversations, a reward function returning None), and the loss, its metrics and the gradients equal TRL's
_compute_loss (fp32) for every --loss-type, with beta 0 and > 0, on the first use of a rollout and on a later one
(--num-iterations > 1: old log-probs of another policy), at another temperature."""
import functools

import pytest
import torch
from chat_model import make_chat_llama
from grpo_parity import (CHAT_PROMPTS, LOSS_METRICS, STRING_PROMPTS, fixed_completions, hf_completion_logps,
                         our_config, our_step, our_training, trl_loss, trl_scored, trl_trainer, write_prompts)
from parity import close
from preference_parity import moved_copy

from colozoo.checkpoint.readers import StateDictReader

pytest.importorskip("trl")
ATOL = 1e-5
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: one thread is fastest, on a busy machine by far


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    base = make_chat_llama(root / "base")
    return {"root": root, "base": base, "policy": moved_copy(base, root / "policy"),
            "strings": write_prompts(root / "strings.jsonl", STRING_PROMPTS),
            "conversations": write_prompts(root / "conversations.jsonl", CHAT_PROMPTS)}


@functools.lru_cache(maxsize=None)
def trl_side(root, fmt: str, temperature: float = 1.0):
    trainer, records = trl_trainer(root / "policy", root / f"{fmt}.jsonl", temperature)
    return trainer, records, fixed_completions(trainer.processing_class)


def check_metrics(ours: dict, theirs: dict, what: str):
    assert set(theirs) <= set(ours), (what, set(theirs) - set(ours))
    for key, value in theirs.items():
        close(ours[key], value, ATOL, f"{what}: {key}")


@pytest.mark.parametrize("fmt", ["strings", "conversations"])
@pytest.mark.parametrize("scale_rewards,mask_truncated", [("group", False), ("batch", True), ("none", False)])
def test_rewards_advantages_and_rollout_metrics_equal_trl(setup, fmt, scale_rewards, mask_truncated, tmp_path):
    trainer, records, completions = trl_side(setup["root"], fmt)
    inputs, expected = trl_scored(trainer, records, completions, scale_rewards, mask_truncated)
    cfg = our_config(setup["base"], setup[fmt], tmp_path, scale_rewards=scale_rewards,
                     mask_truncated_completions=mask_truncated)
    model, training = our_training(cfg, setup["policy"])
    _, metrics, _ = our_step(training, model, completions)
    what = f"{fmt}, scale_rewards {scale_rewards}{', truncated masked' if mask_truncated else ''}"
    check_metrics(metrics, expected, what)
    close(training.rollout.advantages, inputs["advantages"], ATOL, f"{what}: advantages")
    assert int((training.rollout.labels != -100).sum()) == int(inputs["num_items_in_batch"])


@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_metrics_and_gradients_equal_trl_for_every_loss_type(setup, beta, iterations, tmp_path):
    """iterations 2: the rollout's later use, its old log-probs another policy's (the base's), so ratios clip."""
    import transformers

    from parity import check_gradients

    trainer, records, completions = trl_side(setup["root"], "strings")
    inputs, _ = trl_scored(trainer, records, completions)
    other = hf_completion_logps(setup["base"], inputs)
    old = other if iterations > 1 else None
    ref = (other + 0.3 * torch.sin(other)) if beta else None  # a reference other than the old policy
    hf = transformers.AutoModelForCausalLM.from_pretrained(setup["policy"], dtype=torch.float32)
    for loss_type in LOSS_TYPES:
        what = f"{loss_type}, beta {beta}, iteration {iterations}"
        expected_loss, expected, grads = trl_loss(trainer, inputs, loss_type, beta, old, ref)
        cfg = our_config(setup["base"], setup["strings"], tmp_path, loss_type=loss_type, beta=beta,
                         num_iterations=iterations)
        model, training = our_training(cfg, setup["policy"])
        loss, _, metrics = our_step(training, model, completions, old, ref)
        close(loss, expected_loss, ATOL, f"{what}: loss")
        check_metrics(metrics, {k: v for k, v in expected.items() if k in LOSS_METRICS}, what)
        if iterations > 1 and loss_type != "cispo":
            assert expected["clip_ratio/region_mean"] > 0, what  # the clipped regions are exercised
        if loss_type in ("dapo", "cispo"):
            check_gradients(model, model.parallel, StateDictReader(hf.state_dict()), StateDictReader(grads), ATOL)


def test_loss_at_another_temperature_equals_trl(setup, tmp_path):
    """The log-probs trained on are those of the distribution sampled from: the logits over the temperature."""
    trainer, records, completions = trl_side(setup["root"], "conversations", 0.7)
    inputs, expected_rollout = trl_scored(trainer, records, completions)
    old = hf_completion_logps(setup["base"], inputs, temperature=0.7)
    expected_loss, expected, _ = trl_loss(trainer, inputs, "grpo", 0.0, old=old)
    cfg = our_config(setup["base"], setup["conversations"], tmp_path, loss_type="grpo", temperature=0.7,
                     num_iterations=3)
    model, training = our_training(cfg, setup["policy"])
    loss, metrics, update = our_step(training, model, completions, old)
    close(loss, expected_loss, ATOL, "loss at temperature 0.7")
    check_metrics(update, {k: v for k, v in expected.items() if k in LOSS_METRICS}, "temperature 0.7")
    check_metrics(metrics, expected_rollout, "temperature 0.7")


# --- the same first step on every mesh --------------------------------------------------------------------------

MESHES = {  # name: (degrees, data parallelism, micro-batches, options); "dp2" samples other completions (its own seeds)
    "tp2": (dict(tp=2), "fsdp", 1, dict(beta=0.04)),  # LoRA: the reference is the base, adapters switched off
    "pp2": (dict(pp=2), "fsdp", 2, dict(beta=0.04, num_iterations=2)),  # a frozen reference copy; old log-probs
    "dp2": (dict(dp=2), "fsdp", 1, dict(loss_type="grpo")),
}


@pytest.fixture(scope="module")
def adapter(setup):
    from grpo_parity import random_adapter

    return random_adapter(setup["base"], setup["root"] / "adapter")


@pytest.mark.parametrize("mesh", list(MESHES))
def test_first_step_is_the_same_on_every_mesh(setup, adapter, mesh, tmp_path):
    """tp2 and pp2 sample the same completions as one process (the same seed, the same draws on every rank); dp2's
    replicas sample their own, and one process trained on those gives the same step."""
    from distributed import run_distributed
    from grpo_parity import mesh_step

    degrees, data_parallel, micro, options = MESHES[mesh]
    lora = adapter if mesh == "tp2" else None
    args = (setup["base"], setup["base"] if lora else setup["policy"], setup["strings"], tmp_path)
    got = run_distributed(mesh_step, 2, *args, degrees, data_parallel, micro, lora, timeout=150, **options)
    loss, metrics, completions, norm = got[0]
    assert all(rank[2] == completions for rank in got), f"{mesh}: ranks sampled different completions"
    given = completions if mesh == "dp2" else None
    expected = mesh_step(*args, {}, "fsdp", micro, lora, completions=given, **options)
    if given is None:  # under dp2 one process is handed the mesh's completions: nothing to compare
        assert completions == expected[2], f"{mesh}: other completions than one process's"
    if options.get("beta"):  # the reference is the base (adapters off / the frozen copy), not the policy
        assert expected[1]["kl"] > 1e-3, expected[1]["kl"]
    for rank_loss, rank_metrics, _, rank_norm in got:
        close(rank_loss, expected[0], ATOL, f"{mesh}: loss")
        check_metrics(rank_metrics, expected[1], mesh)
        close(rank_norm, expected[3], ATOL, f"{mesh}: gradient norm")


@pytest.mark.parametrize("vocab", [158, 157, 3])
def test_entropy_from_vocab_slices_equals_the_whole_vocabulary(vocab):
    """Two tp ranks' slices, one of them padded (157), one holding a single real token (3)."""
    from distributed import run_distributed
    from grpo_parity import entropy_error

    assert max(run_distributed(entropy_error, 2, vocab, timeout=60)) < 1e-5
