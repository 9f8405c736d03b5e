"""The profiler and planner under LoRA: only the adapters have gradients, optimizer states and data-parallel
gradient traffic; their count per rank follows the tensor-parallel layout of the adapters."""
import torch
import transformers

from colozoo.api import build_model
from colozoo.cost.planner import plan_for
from colozoo.cost.profiler import profile_for
from colozoo.runtime.lora import LoraSettings, apply_lora, lora_modules

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=64)
R = 8
ALL_LINEAR = LoraSettings(r=R, targets="all-linear")


def expected_adapters(tp: int) -> int:
    """Per layer on one tp rank: column bases keep A (r x in) whole and split B; row bases split A, keep B."""
    h, inner, q, kv = 64, 96, 64, 32
    column = sum(R * h + out * R // tp for out in (q, kv, kv, inner, inner))  # q, k, v, gate, up
    row = (R * h // tp + h * R) + (R * inner // tp + h * R)  # o_proj, down_proj
    return 4 * (column + row)


def test_profile_counts_only_adapters_as_trainable():
    config = transformers.AutoConfig.for_model("llama", **LLAMA)
    model = apply_lora(build_model(config, device="cpu"), r=R, targets="all-linear")
    actual = sum(p.numel() for a in lora_modules(model).values() for p in (a.A, a.B))
    assert actual == expected_adapters(1)
    for tp in (1, 2):
        full = profile_for(config, batch_size=2, seq_len=32, mesh=f"tp={tp},dp=2", dtype="bfloat16")
        lora = profile_for(config, batch_size=2, seq_len=32, mesh=f"tp={tp},dp=2", dtype="bfloat16", lora=ALL_LINEAR)
        stage, base = lora.stages[0], full.stages[0]
        n = expected_adapters(tp)
        assert stage["trainable"] == n and base["trainable"] == -1
        assert stage["grads"] == 4 * n and stage["optimizer"] == 8 * n and stage["master"] == 0
        assert stage["weights"] == base["weights"] + 4 * n  # the frozen base, plus fp32 adapters
        assert lora.comm["dp_cp.all_reduce"] == 4 * n < full.comm["dp_cp.all_reduce"]
        assert lora.peak_memory < full.peak_memory


def test_plan_with_lora_needs_less_memory():
    kw = dict(gpus=2, gpu_memory="80GB", seq_len=512, global_batch=8, micro_batch_sizes=(2,), schedules=("1f1b",))
    lora_16 = LoraSettings(r=16, targets="all-linear")
    full, lora = plan_for("opt-125m", **kw).best, plan_for("opt-125m", lora=lora_16, **kw).best
    assert lora.memory < full.memory


def test_adapter_count_with_kv_heads_replicated_over_tp():
    from colozoo.cost.lora import adapter_params_per_layer

    config = transformers.AutoConfig.for_model("llama", **LLAMA)  # 4 kv heads of 8 features: at tp=8, 2 ranks each
    counts = adapter_params_per_layer(config, tp=8, lora=LoraSettings(r=R, targets=("k_proj",)))
    assert counts == {str(i): R * 64 + 8 * R for i in range(4)}  # A whole, B one whole kv head on every rank


BERT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            num_labels=3, max_position_embeddings=64)


def test_modules_to_save_count_as_trainable():
    """A LoRA classifier trains its head whole (PEFT's SEQ_CLS modules_to_save): gradients, optimizer states and
    gradient all-reduce count it beside the adapters, on the last pipeline stage only."""
    config = transformers.AutoConfig.for_model("bert", **BERT)
    model = apply_lora(build_model(config, device="cpu", task="sequence_classification"), r=R, targets="all-linear")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head = 64 * 3 + 3
    adapters = sum(p.numel() for a in lora_modules(model).values() for p in (a.A, a.B))
    assert trainable == adapters + head
    kw = dict(batch_size=2, seq_len=32, mesh="dp=2", dtype="bfloat16", lora=ALL_LINEAR)
    plain = profile_for(config, **kw).stages[0]
    cls = profile_for(config, task="sequence_classification", **kw)
    stage = cls.stages[0]
    assert plain["trainable"] == adapters and stage["trainable"] == trainable
    assert stage["grads"] == 4 * trainable and stage["optimizer"] == 8 * trainable and stage["master"] == 0
    assert stage["weights"] == plain["weights"]  # the head is already among the base weights
    assert cls.comm["dp_cp.all_reduce"] == 4 * trainable
    frozen_head = LoraSettings(r=R, targets="all-linear", modules_to_save=())
    nothing_saved = profile_for(config, task="sequence_classification", **{**kw, "lora": frozen_head}).stages[0]
    assert nothing_saved["trainable"] == adapters
    first, last = profile_for(config, task="sequence_classification", **{**kw, "mesh": "pp=2"}).stages
    assert first["trainable"] == adapters // 2 and last["trainable"] == adapters // 2 + head
