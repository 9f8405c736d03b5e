"""Published training runs (colozoo/cost/published_runs.json): what each ran (model, hardware and network, GPUs,
layout, schedule, micro-batching, recompute, software) and what it measured, read into the planner's types.

A run's measured throughput is converted to a step time the way its source counts FLOPs:

- "narayanan2021": F = 96 B s l h^2 (1 + s/6h + V/16lh), which counts the recomputed forward (Narayanan et al.
  2021, eq. 3); a measured step is F / (GPUs x TFLOP/s per GPU);
- "megatron_core": 12 B s l h^2 ((1 + g/a + s/h) q/h + f/h + V/2lh), Megatron-Core's model FLOPs (g: key/value
  groups, a: heads, q: query projection width, f: MLP width, times 3/2 with SwiGLU); with the model's "flops":
  "causal", s/2h for s/h (sources that count the causal attention core's computed half); MoE models count f
  once per expert a token runs ("experts_per_token"), as Megatron-Core does;
- "tokens_per_gpu": tokens per second per GPU; "step_seconds": the step time itself.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from colozoo.cost.hardware import Hardware, get_hardware
from colozoo.cost.published_schema import FAMILIES, PublishedRunError, check_shape, check_table
from colozoo.cost.setup import Workload
from colozoo.cost.software import Software
from colozoo.runtime.plan import Plan

RUNS_FILE = Path(__file__).with_name("published_runs.json")


@dataclass(frozen=True)
class PublishedRun:
    id: str
    source: str
    model: dict                  # family and sizes (see config()), or {"registry": name}
    hardware: Hardware           # the preset with the run's network, all its GPUs
    plan: Plan
    workload: Workload
    software: Software
    global_batch: int
    measured: dict               # {"value": ..., "unit": "narayanan2021" | "megatron_core" | ...}
    held_out: bool = False       # not looked at while choosing the cost model's terms
    group: str = ""
    notes: str = ""
    known_miss: str = ""         # why the cost model misses this run by more than the tolerance (empty: it does not)
    memory_miss: str = ""        # why the memory model does not fit this run in its GPUs (empty: it fits)

    @property
    def gpus(self) -> int:
        return self.hardware.gpus

    def config(self):
        return model_config(self.model)

    def flops(self) -> float:
        """FLOPs of one step as the source counts them (None for throughputs in tokens or seconds)."""
        return step_flops(self.model, self.global_batch, self.workload.seq_len, self.measured["unit"])

    def measured_seconds(self) -> float:
        unit, value = self.measured["unit"], self.measured["value"]
        if unit == "step_seconds":
            return value
        if unit == "tokens_per_gpu":
            return self.global_batch * self.workload.seq_len / self.gpus / value
        return self.flops() / (self.gpus * value * 1e12)

    def in_source_units(self, seconds: float) -> float:
        """A step time in the unit the source measured in (TFLOP/s per GPU, tokens/s per GPU or seconds)."""
        unit = self.measured["unit"]
        if unit == "step_seconds":
            return seconds
        if unit == "tokens_per_gpu":
            return self.global_batch * self.workload.seq_len / self.gpus / seconds
        return self.flops() / (self.gpus * seconds) / 1e12


def step_flops(model: dict, batch: int, seq: int, unit: str) -> float | None:
    h, layers, vocab = model.get("hidden"), model.get("layers"), model.get("vocab")
    if unit == "narayanan2021":
        return 96 * batch * seq * layers * h ** 2 * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    if unit == "megatron_core":
        heads = model["heads"]
        groups, ffn = model.get("kv_heads", heads), model.get("ffn", 4 * h)
        gated = 1.5 if model.get("family") in ("llama", "mixtral") else 1.0
        ffn *= model.get("experts_per_token", 1)  # MoE: the experts each token runs
        causal = 2 if model.get("flops") == "causal" else 1  # the source counts the causal core's half only
        attention = 1 + groups / heads + seq / (causal * h)  # query width = hidden
        return 12 * batch * seq * layers * h * h * (attention + ffn / h * gated + vocab / (2 * layers * h))
    return None


# sizes a row may give beside a registry name, each replacing its config's field (the sequence stays the run's)
REGISTRY_SIZES = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                  "kv_heads": "num_key_value_heads", "ffn": "intermediate_size", "vocab": "vocab_size",
                  "tied": "tie_word_embeddings", "experts_per_token": "num_experts_per_tok"}


def model_config(model: dict):
    """A transformers config of a published model: GPT ("gpt2": learned positions, LayerNorm, GeLU, tied
    embeddings, as Megatron's GPT) or LLaMA from its sizes, or a registry name (the sizes given beside it
    replacing its config's)."""
    import transformers

    if "registry" in model:
        from colozoo.cost.setup import get_config

        config = get_config(model["registry"])
        given = {REGISTRY_SIZES[k]: v for k, v in model.items() if k in REGISTRY_SIZES}
        if not given:
            return config
        fields = config.to_dict()
        if {"hidden_size", "num_attention_heads"} & set(given):
            fields.pop("head_dim", None)  # derived again from the sizes given
        return type(config)(**{**fields, **given})
    h, ffn, dropout = model["hidden"], model.get("ffn", 4 * model["hidden"]), model.get("dropout", 0.0)
    if model["family"] == "gpt2":
        from colozoo.models import model_class

        return model_class("gpt2").config_from_sizes(h, model["layers"], model["heads"], ffn, model["vocab"],
                                                      model["seq"], dropout, model.get("tied", True))
    if model["family"] == "llama":
        return transformers.LlamaConfig(hidden_size=h, intermediate_size=ffn, num_hidden_layers=model["layers"],
                                        num_attention_heads=model["heads"],
                                        num_key_value_heads=model.get("kv_heads", model["heads"]),
                                        vocab_size=model["vocab"], max_position_embeddings=model["seq"],
                                        tie_word_embeddings=model.get("tied", False))
    raise PublishedRunError(f"published model family {model['family']!r} is not one of {', '.join(FAMILIES)}")


def _plan(layout: dict, layers: int, row: str) -> Plan:
    tp, pp, dp = layout.get("tp", 1), layout.get("pp", 1), layout.get("dp", 1)
    cp, v = layout.get("cp", 1), layout.get("virtual_stages", 1)
    counts = layout.get("layers_per_stage")
    if counts is None and layout.get("balance", "layers") == "layers" and pp > 1:
        if layers % (pp * v):
            raise PublishedRunError(f"{row}: {layers} layers do not split evenly over pp * v = {pp * v} stages")
        counts = [layers // (pp * v)] * (pp * v)
    m = layout["global_batch"] // (dp * layout["micro_batch"])
    try:
        return Plan(tp=tp, pp=pp, dp=dp, cp=cp, ep=layout.get("ep", 1),
                    sequence_parallel=layout.get("sequence_parallel", False), micro_batch_size=layout["micro_batch"],
                    num_microbatches=m, schedule=layout.get("schedule", "interleaved_1f1b" if v > 1 else "1f1b"),
                    zero=layout.get("zero", 0), checkpointing=layout.get("recompute", "none"), virtual_stages=v,
                    layers_per_stage=tuple(counts) if counts else None,
                    reshard_after_forward=layout.get("reshard_after_forward", True))
    except ValueError as e:
        raise PublishedRunError(f"{row}: {e}") from None


def _run(row: dict, software: dict, networks: dict) -> PublishedRun:
    rid = row["id"]
    net = networks.get(row.get("network"), {})
    gpus = row["gpus"]
    hw = get_hardware(row["hardware"], gpus=gpus, **net.get("fields", {}))
    if net:
        hw = replace(hw, name=f"{hw.name} ({row['network']})",
                     sources={**hw.sources, **{k: net["source"] for k in net.get("fields", {})}})
    layout = row["layout"]
    plan = _plan(layout, row["model"].get("layers", 0), f"run {rid!r}")
    if plan.world_size != gpus:
        raise PublishedRunError(f"run {rid!r}: tp*pp*dp*cp = {plan.world_size} != gpus = {gpus}")
    fields = preset_fields(row.get("software", {}), software)
    runs_software = Software(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    workload = Workload(seq_len=row["model"]["seq"], dtype=row.get("dtype", "bfloat16"),
                        target=row.get("attention", "cuda"))
    return PublishedRun(rid, row["source"], row["model"], hw, plan, workload, runs_software, layout["global_batch"],
                        row["measured"], row.get("held_out", False), row.get("group", ""), row.get("notes", ""),
                        row.get("known_miss", ""), row.get("memory_miss", ""))


def preset_fields(spec: dict, software: dict) -> dict:
    """The Software fields `spec` sets: its own over its base preset's, over that one's base's, down to colozoo's
    defaults (published_schema.check_presets has refused unknown bases and circles)."""
    own = {k: v for k, v in spec.items() if k not in ("base", "source")}
    base = spec.get("base", "colozoo")
    return {**(preset_fields(software[base], software) if base != "colozoo" else {}), **own}


def published_runs(path: str | None = None) -> tuple[PublishedRun, ...]:
    """Every run of the table: the package's, or the JSON file at `path` as it is now, whose rows may name the
    package's software presets and networks as well as any the file adds (same layout as
    colozoo/cost/published_runs.json)."""
    return _package_runs() if path is None else _runs(_read_table(path), _package_table())


@cache
def _package_table() -> dict:  # read once: the package's file does not change under a running process
    return json.loads(RUNS_FILE.read_text())


@cache
def _package_runs() -> tuple[PublishedRun, ...]:
    return _runs(_package_table(), _package_table())


def _runs(data: dict, package: dict) -> tuple[PublishedRun, ...]:
    check_shape(data)
    software = {**package["software"], **data.get("software", {})}
    networks = {**package["networks"], **data.get("networks", {})}
    check_table(data, software, networks)
    return tuple(_run(row, software, networks) for row in data["runs"])


def _read_table(path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise PublishedRunError(f"{path}: not JSON ({e})") from None
