"""Everything a fine-tuning run checks before it loads the model: the mesh, the model's config, the data, the plan
and the output directory, so bad input costs seconds and leaves nothing behind."""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from colozoo.checkpoint import layout
from colozoo.core.mesh import ParallelConfig
from colozoo.core.sequence import SPLIT_REASON
from colozoo.finetune import data as D
from colozoo.finetune import grpo_data, preference_data, runtime, sft, token_cache
from colozoo.finetune.config import FinetuneConfig
from colozoo.finetune.metrics import tensorboard_writer_class
from colozoo.runtime.plan import Plan


@dataclass
class Inputs:
    """What the checks found: the model's config, the data, and the mesh and global batch they train on."""
    config: object                       # the model's transformers config (--num-labels applied)
    train: D.TensorData
    evaluation: D.TensorData | None
    tokenizer: object | None             # None for images
    notes: list[str]                     # warnings about the tokenizer, printed once training starts
    plan: Plan | None                    # --plan auto's plan
    mesh: ParallelConfig
    global_batch: int
    model_dir: Path | None = None        # the model's directory: its tokenizer and generation files


def check_inputs(cfg: FinetuneConfig, checked: tuple | None = None) -> Inputs:
    """Check the degrees and the model's config (unless `checked`: check_model_and_mesh's result), read the data,
    plan under --plan auto (collective), and check that the data fills a global batch and the output can be
    written."""
    cfg.check_paths()
    mesh, config, directory = checked or check_model_and_mesh(cfg)
    train, evaluation, tokenizer = build_datasets(cfg, config, directory)
    notes = D.tokenizer_warnings(tokenizer, config, train) if tokenizer is not None else []
    notes += data_notes(cfg, train, evaluation)
    if cfg.plan is None:
        plan, global_batch = None, cfg.global_batch_size or cfg.micro_batch_size * mesh.dp
    else:
        plan, mesh, global_batch = plan_run(cfg, config)
    D.BatchSampler(len(train), cfg.samples_per_step(global_batch), 0, mesh.dp, cfg.seed)  # data for one step
    check_writable(Path(cfg.output))
    if cfg.tensorboard:
        tensorboard_writer_class()  # a missing tensorboard package fails before the model loads
    return Inputs(config, train, evaluation, tokenizer, notes, plan, mesh, global_batch,
                  Path(directory) if directory is not None else None)


def check_model_and_mesh(cfg: FinetuneConfig, world: int | None = None) -> tuple[ParallelConfig | None, object, object]:
    """What needs neither ranks nor data (`colozoo finetune --nproc-per-node` checks it before it starts any):
    the degrees against the world size and the model's heads and layers, the global batch against micro batch x dp,
    --seq-len against the model's positions. Returns (the mesh, or None under --plan auto; the model's config with
    --num-labels applied; the directory holding the tokenizer, or None)."""
    mesh = None
    if cfg.plan is None:
        mesh = check_mesh(cfg, world=world)
        cfg.num_microbatches(mesh.dp)
        cfg.samples_per_step(cfg.global_batch_size or cfg.micro_batch_size * mesh.dp)
    if cfg.method == "grpo":
        from colozoo.finetune.rewards import RewardFunctions

        RewardFunctions(cfg.reward_list(), cfg.weights_of_rewards())  # each imports, before anything loads
    config, directory = model_source(cfg.model)
    if cfg.num_labels is not None:
        config.num_labels = cfg.num_labels
    if cfg.plan is None:
        layout.check_mesh(config, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep)  # heads over tp, layers over pp, experts over ep
        check_sequence_split(cfg, mesh)
    if cfg.method in ("dpo", "grpo") and getattr(config, "output_router_logits", False):
        raise ValueError(f"--method {cfg.method} does not add MoE router losses to its loss yet, and {cfg.model}'s "
                         f"config sets output_router_logits: set it to false to train without them")
    if cfg.task != "imgcls" and cfg.method != "grpo":  # grpo: each prompt + --max-completion-length, when read
        dpo_length = cfg.method == "dpo" and cfg.max_length is not None
        D.check_seq_len(cfg.sequence_length(), config, "--max-length" if dpo_length else "--seq-len")
    if cfg.eval_tasks:
        from colozoo.finetune.evaluation import harness_tasks

        harness_tasks(cfg)  # lm-eval installed, the tasks known, their data readable
    return mesh, config, directory


def data_notes(cfg: FinetuneConfig, train, evaluation) -> list[str]:
    """What --chat had to drop or shorten to fit --seq-len, per dataset file (counted when it was tokenized)."""
    found = []
    for path, data in ((cfg.data, train), (cfg.eval_data, evaluation)):
        stats = getattr(data, "stats", None)
        if cfg.method == "grpo":
            note = grpo_data.fit_note(stats, path, cfg.max_prompt_length) if path else None
        elif cfg.method == "dpo":
            note = preference_data.fit_note(stats, path, cfg.sequence_length(), cfg.max_prompt_length) if path else None
        else:
            note = sft.fit_note(stats, path, cfg.seq_len) if path else None
        if note:
            found.append(note)
    return found


def model_source(name_or_path: str):
    """(transformers config, directory holding the tokenizer or None), without loading any weights."""
    from colozoo.api import resolve

    source = resolve(name_or_path, verify=True)  # checksums are checked when weights are read
    return source.config, getattr(source, "path", None)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_mesh(cfg: FinetuneConfig, plan: Plan | None = None, world: int | None = None) -> ParallelConfig:
    """The mesh of the config's degrees, or of the plan's under --plan auto, for `world` processes (default:
    torchrun's WORLD_SIZE)."""
    return ParallelConfig.for_world(world or world_size(), **runtime.mesh_degrees(cfg, plan))


def check_sequence_split(cfg: FinetuneConfig, mesh: ParallelConfig):
    """A row's length (--seq-len; --max-length of --method dpo) splits over the mesh: 2 x cp chunks, and each cp
    rank's share over tp under sequence parallelism (an image's sequence is padded by the model itself)."""
    multiple = mesh.sequence_multiple
    if cfg.task != "imgcls" and cfg.sequence_length() % multiple:
        flag = "--max-length" if cfg.method == "dpo" and cfg.max_length is not None else "--seq-len"
        raise ValueError(f"{flag} {cfg.sequence_length()} must be a multiple of {multiple} (cp={mesh.cp}, tp={mesh.tp}"
                         f"{', sequence parallel' if mesh.sequence_parallel else ''}): {SPLIT_REASON}")


def plan_run(cfg: FinetuneConfig, config) -> tuple[Plan, ParallelConfig, int]:
    """--plan auto: (the plan, its mesh, the global batch it splits: --global-batch-size, else micro batch x world)."""
    global_batch = cfg.global_batch_size or cfg.micro_batch_size * world_size()
    plan = runtime.plan_training(cfg, config, global_batch)
    mesh = check_mesh(cfg, plan)
    check_sequence_split(cfg, mesh)
    if plan.dp * plan.micro_batch_size * plan.num_microbatches != global_batch:
        raise ValueError(f"the plan {plan} does not split the global batch of {global_batch} into dp x micro batch "
                         f"x micro-batches")
    return plan, mesh, global_batch


def build_datasets(cfg: FinetuneConfig, config, directory) -> tuple[D.TensorData, D.TensorData, object]:
    """(train, eval, tokenizer or None), checked against the model's config."""
    tokenizer = None
    if cfg.task == "imgcls":
        read = lambda path, role: D.image_dataset(path, config, directory)  # noqa: E731
    else:
        tokenizer = D.load_tokenizer(directory, config.vocab_size, D.special_token_ids(config))
        if cfg.method == "grpo":
            read = lambda path, role: grpo_data.prompt_dataset(  # noqa: E731
                path, tokenizer, cfg.max_completion_length, cfg.max_prompt_length,
                getattr(config, "max_position_embeddings", None))
        elif cfg.method == "dpo":
            read = lambda path, role: preference_data.preference_dataset(  # noqa: E731
                path, tokenizer, cfg.sequence_length(), cfg.max_prompt_length)
        elif cfg.chat or cfg.task == "lm":
            read = lambda path, role: token_cache.lm_rows(cfg, tokenizer, path, role)  # noqa: E731
        else:
            read = lambda path, role: D.classification_dataset(path, tokenizer, cfg.seq_len, config,  # noqa: E731
                                                               cfg.text_field, cfg.label_field)
    train = read(cfg.data, "train")
    if cfg.eval_data:
        evaluation = read(cfg.eval_data, "eval")
    elif cfg.eval_fraction > 0:
        train, evaluation = train.split(cfg.eval_fraction)
    else:
        evaluation = None
    return train, evaluation, tokenizer


def check_writable(output: Path):
    """Before the model is loaded: the output directory can be created and written (every rank writes shards)."""
    probe = output / f".write-test-{os.getpid()}"
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"cannot write to the output directory {output}: {e.strerror or e}") from None


@dataclass
class OutputBefore:
    """What the output directory held before a run wrote anything."""
    created: Path                        # the outermost directory the run makes (the output itself if it exists)
    existed: bool
    cached: set | None                   # the token caches present, None without a data-cache directory


def output_before(output) -> OutputBefore:
    output = Path(output).absolute()
    created = output
    while not created.parent.exists():
        created = created.parent
    cache = output / "data-cache"
    return OutputBefore(created, output.exists(), set(cache.iterdir()) if cache.is_dir() else None)


@contextmanager
def nothing_left_if_refused(output, before: OutputBefore | None = None):
    """A run refused (or stopped) before it trains leaves nothing behind: the output directory and its parents when
    it made them (`before`: what existed, default now), else the token caches it made in it. The first process of
    each machine removes them."""
    output = Path(output).absolute()
    before = before or output_before(output)
    cache = output / "data-cache"
    try:
        yield
    except BaseException:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            if not before.existed:
                shutil.rmtree(before.created, ignore_errors=True)
            elif before.cached is None:
                shutil.rmtree(cache, ignore_errors=True)
            elif cache.is_dir():
                for entry in set(cache.iterdir()) - before.cached:
                    shutil.rmtree(entry, ignore_errors=True)
        raise
