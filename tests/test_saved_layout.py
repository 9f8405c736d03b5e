"""What a framework saves differently from colozoo's layers: module recompute (layer norms, the experts'
activation) and Megatron-Core's folded experts, on a tiny Mixtral traced at tp 2 with sequence parallelism."""
import warnings

import pytest

from colozoo.cost.saved_layout import (LAYERNORM, MOE_ACT, dropped_bytes, fused_norm_bytes, fused_swiglu_bytes,
                                       moe_shard_bytes, recomputed, sequence_shard_bytes)
from colozoo.cost.software import Software
from colozoo.runtime.plan import Plan
from tests.helpers.family_cases import tiny_config

warnings.filterwarnings("ignore", category=FutureWarning)

SAVED = {"input_layernorm|mul|(64,)": 30, "self_attn.qkv|_ColumnParallel|(64,)": 20, "mlp.experts|grouped_mm|(64,)": 40,
         "mlp.experts|grouped_mm|(128,)": 50, "mlp.experts|mul|(128,)": 70, "mlp|index_add|(64,)": 40}


def test_module_recompute_drops_norms_and_the_experts_activation():
    assert set(recomputed(SAVED, (LAYERNORM,))) == {"input_layernorm|mul|(64,)"}
    # the activation's inputs go, the expert GEMMs' inputs stay
    assert set(recomputed(SAVED, (MOE_ACT,))) == {"mlp.experts|mul|(128,)"}
    with pytest.raises(ValueError, match="not priced"):
        recomputed(SAVED, ("mlp",))


def test_folded_experts_keep_a_tp_share_of_the_hidden_wide_rows():
    # hidden 64 at tp 2: half of the dispatched rows and the combine (40 + 40), nothing outside the MoE block
    assert moe_shard_bytes(SAVED, 64, 2) == 40
    assert moe_shard_bytes(SAVED, 64, 1) == 0
    # experts split over tp (Megatron-Core's dispatcher, unfolded) gather each dispatched row whole again: only the
    # MoE block's own hidden-wide tensors (here the combine) stay on the shard
    assert moe_shard_bytes(SAVED, 64, 2, experts_whole=False) == 20
    # a dense layer's MLP is not routed: its hidden-wide inputs stay as they are
    assert moe_shard_bytes({"mlp.gate_up|_ColumnParallel|(64,)": 30, "mlp|mm|(64,)": 10}, 64, 2) == 0
    assert dropped_bytes(SAVED, (LAYERNORM, MOE_ACT), 64, 2) == 30 + 70 + 40


def test_fused_norms_keep_their_input_and_sp_linears_their_shard():
    assert fused_norm_bytes(SAVED, {"input_layernorm": 10}) == 20  # 30 saved, of which its input 10
    assert fused_norm_bytes(SAVED, {}) == 0
    assert sequence_shard_bytes(SAVED, 4) == 15  # the gathered 20 kept as a quarter


def test_fused_swiglu_keeps_only_its_two_inputs():
    # the gated activation saves gate, up and the activated gate (3 x 10); the down projection's input is 10 wide
    dense = {"mlp|mul|(32,)": 30, "mlp|mm|(32,)": 10, "mlp.experts|mul|(32,)": 30}
    assert fused_swiglu_bytes(dense) == 10  # the experts' activation is moe_act's (recompute_modules)
    assert fused_swiglu_bytes(SAVED) == 0  # no dense MLP down projection: nothing to drop


def test_recompute_module_names_are_spelled_once():
    """The module names the cost model prices are written once, where saved_layout defines them: every other
    module of colozoo/ (and saved_layout itself) uses the constants."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "colozoo"
    spelled = [(str(path.relative_to(root)), node.value) for path in root.rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and node.value in ("layernorm", "moe_act")]
    assert sorted(spelled) == [("cost/saved_layout.py", "layernorm"), ("cost/saved_layout.py", "moe_act")]


@pytest.fixture(scope="module")
def mixtral_trace():
    from colozoo.core.mesh import ParallelConfig
    from colozoo.cost.model_trace import trace_model

    mesh = ParallelConfig(tp=2, dp=2, ep=2, sequence_parallel=True)
    return trace_model(tiny_config("mixtral"), 1, 32, mesh, "bfloat16", "cuda")


def test_assemble_saves_as_the_software_does(mixtral_trace):
    from colozoo.cost.cost_model import assemble
    from colozoo.cost.setup import Workload

    plan = Plan(tp=2, dp=2, ep=2, sequence_parallel=True, micro_batch_size=1)
    w = Workload(seq_len=32)

    def activations(software=None):
        return sum(s["activations"] for s in assemble(mixtral_trace, plan, w, software).stages)

    unit = mixtral_trace.units["layer:0"]
    assert sum(unit.module_saved.values()) == unit.saved_bytes  # every saved byte has its module
    base = activations()
    hidden = mixtral_trace.config.hidden_size
    n = len(mixtral_trace.layers)
    for software, drop in ((Software(recompute_modules=(LAYERNORM, MOE_ACT)),
                            dropped_bytes(unit.module_saved, (LAYERNORM, MOE_ACT))),
                           (Software(expert_tp_folded=True), dropped_bytes(unit.module_saved, (), hidden, 2)),
                           (Software(expert_dispatch_sharded=True),
                            dropped_bytes(unit.module_saved, (), hidden, 2, experts_whole=False)),
                           (Software(fused_norm=True), fused_norm_bytes(unit.module_saved, unit.norm_inputs)),
                           (Software(sequence_parallel_saves_shard=True), sequence_shard_bytes(unit.module_saved, 2))):
        assert drop > 0, software
        assert activations(software) == pytest.approx(base - n * drop, rel=1e-6)


def test_what_assemble_keeps_with_a_trace_follows_the_plan_and_dtype(mixtral_trace):
    """The trace's memo holds what assemble derived from it; a second plan or dtype gets its own entry, not the
    first call's (the keys and values ring attention passes are sized by tp and the dtype)."""
    from colozoo.cost.cost_model import assemble
    from colozoo.cost.setup import Workload

    def kv_bytes(tp, dtype):
        plan = Plan(tp=tp, dp=4 // tp, ep=2, sequence_parallel=True, micro_batch_size=1)
        return [u["kv_bytes"] for u in assemble(mixtral_trace, plan, Workload(seq_len=32, dtype=dtype)).units]

    bf16 = kv_bytes(2, "bfloat16")
    assert max(bf16) > 0
    assert kv_bytes(2, "float32") == [2 * b for b in bf16]
    assert kv_bytes(1, "bfloat16") == [2 * b for b in bf16]


@pytest.mark.parametrize("tp", [1, 2])
def test_attention_keeps_the_whole_projection_for_v_unless_its_kernel_copies_it(tp):
    """On the torch composition q and k are rotated into tensors of their own while v stays a slice of the fused qkv
    projection's output, which SDPA saves, and with it the whole output: what no saved view covers is the output
    less v. Colozoo's fused path rotates q and k in place, so the three views cover it all. Transformer Engine's
    attention copies the three into tensors of their own (Software.attention_copies_views): the layer keeps v alone."""
    from colozoo.core.mesh import ParallelConfig
    from colozoo.cost.cost_model import assemble
    from colozoo.cost.model_trace import trace_model
    from colozoo.cost.setup import Workload

    config, seq = tiny_config("llama"), 32
    mesh = ParallelConfig(tp=tp, sequence_parallel=tp > 1)
    heads, kv_heads = config.num_attention_heads // tp, config.num_key_value_heads // tp
    head_dim = config.hidden_size // config.num_attention_heads
    projection, v = (heads + 2 * kv_heads) * head_dim * 2 * seq, kv_heads * head_dim * 2 * seq
    composed = trace_model(config, 1, seq, mesh, "bfloat16", "cuda", fusions=False)
    assert composed.units["layer:0"].attention_unviewed_bytes == projection - v
    fused = trace_model(config, 1, seq, mesh, "bfloat16", "cuda", fusions=True)
    assert fused.units["layer:0"].attention_unviewed_bytes == 0

    plan, w = Plan(tp=tp, sequence_parallel=tp > 1, micro_batch_size=1), Workload(seq_len=seq)

    def activations(software=None):
        return sum(s["activations"] for s in assemble(composed, plan, w, software).stages)

    layers = len(composed.layers)
    assert activations(Software(attention_copies_views=True)) == activations() - layers * (projection - v)
