"""The cost model's terms for context and expert parallelism and the interleaved schedule's gradient reduction, each
against a hand count: the keys and values ring attention passes (grouped-query and MLA heads, kv heads copied when
fewer than the tp ranks), a ring hidden behind long blocks and exposed by short
ones, where an expert group lies and what its all-to-all costs on the links it crosses, grouped expert GEMMs priced
per expert, the window the interleaved cool-down gives the gradient reduction, and attention with sinks traced as
the fused kernel a GPU runs."""
import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers

from colozoo.cost.compute_time import gemm_seconds
from colozoo.cost.context_parallel import kv_bytes_per_token, ring_steps
from colozoo.cost.experts import dispatch_combine_seconds, expert_span
from colozoo.cost.hardware import get_hardware
from colozoo.cost.network import collective_seconds, latency_seconds
from colozoo.cost.op_flops import grouped_gemm_shape
from colozoo.cost.step_time import reduce_window
from colozoo.runtime.plan import Plan

warnings.filterwarnings("ignore", category=FutureWarning)

H100 = get_hardware("H100-80GB", gpus=64)


def test_kv_bytes_per_token():
    """Llama 3 405B (8 kv heads of 128) at tp 8: one kv head a rank, K and V of 128 bf16 each; at tp 16 the head is
    copied, not split; GPT-2 (no kv heads): all heads; DeepSeek-V3's MLA: every head's 192-wide key and 128-wide
    value; not a colozoo family: unknown."""
    llama = transformers.LlamaConfig(hidden_size=16384, num_attention_heads=128, num_key_value_heads=8)
    assert kv_bytes_per_token(llama, 8, 2) == 1 * (128 + 128) * 2
    assert kv_bytes_per_token(llama, 16, 2) == 1 * (128 + 128) * 2
    assert kv_bytes_per_token(llama, 2, 2) == 4 * 256 * 2
    gpt2 = transformers.GPT2Config(n_embd=768, n_head=12)
    assert kv_bytes_per_token(gpt2, 1, 2) == 12 * 128 * 2
    mla = transformers.AutoConfig.for_model("deepseek_v3")  # the published attention: 128 heads
    assert kv_bytes_per_token(mla, 8, 2) == 16 * (192 + 128) * 2
    assert kv_bytes_per_token(SimpleNamespace(), 8, 2) is None


def test_ring_steps_hide_behind_long_blocks_only():
    """cp 16 steps: a 1 ms forward block hides a 64 KB pass; a 5 us block (under the hop's latency) does not; a recomputed layer runs its
    forward ring twice; the backward passes the gradients too (twice the bytes)."""
    span = 16
    steps = ring_steps(16e-3, 32e-3, 64e3, 16, H100, span)
    (fwd, fwd_send, n_fwd), (bwd, bwd_send, n_bwd) = steps
    assert (fwd, bwd, n_fwd, n_bwd) == (pytest.approx(1e-3), pytest.approx(2e-3), 15, 15)
    assert fwd_send == pytest.approx(collective_seconds(H100, "send_recv", 64e3, 16, span, 1))
    assert bwd_send == pytest.approx(collective_seconds(H100, "send_recv", 128e3, 16, span, 1))
    assert fwd_send < fwd and bwd_send < bwd
    short = ring_steps(80e-6, 160e-6, 64e3, 16, H100, span)
    assert short[0][1] > short[0][0]
    assert ring_steps(16e-3, 32e-3, 64e3, 16, H100, span, recomputed=True)[0][2] == 30
    assert ring_steps(1.0, 1.0, 1e9, 1, H100, 8) == []


def test_expert_groups_and_their_all_to_all():
    """ep 8 at tp 2: colozoo's groups span 16 ranks (two nodes), Megatron's folded ones 8 (one node). Inside a node
    the dispatch is NCCL's all-to-all over NVLink; across nodes each rank's tokens for its own node ride NVLink
    while the rest take the adapter, at once: the adapter's share sets the pace, faster than all of them over it."""
    assert expert_span(2, 8) == 16 and expert_span(2, 8, folded=True) == 8
    inside = dispatch_combine_seconds(H100, 1e9, 8, 8, 4)
    assert inside == pytest.approx(collective_seconds(H100, "all_to_all", 1e9, 8, 8, 4))
    across = dispatch_combine_seconds(H100, 1e9, 16, 32, 4)  # 16 ranks over 4 nodes: 4 of them a node
    everything_over_the_adapter = collective_seconds(H100, "all_to_all", 1e9, 16, 32, 4)
    adapter_share = 1e9 * 12 / 16 / H100.bandwidth("all_to_all", 32)
    # a gigabyte's steps are far longer than any hop's latency, which they hide: the adapter's share alone
    assert across == pytest.approx(adapter_share) and across < everything_over_the_adapter
    # 15 steps a call, 4 in 16 of them (a ring leaves each node once) between nodes; a kilobyte's steps are
    # shorter than either hop's latency, which they take
    assert latency_seconds(H100, "all_to_all", 16, 4, 4) == pytest.approx(
        4 * (11.25 * H100.collective_latency_s + 3.75 * H100.inter_node_latency_s))
    assert dispatch_combine_seconds(H100, 1e3, 16, 32, 4) == pytest.approx(
        latency_seconds(H100, "all_to_all", 16, 4, 4))
    assert dispatch_combine_seconds(H100, 1e9, 1, 8, 4) == 0.0


def test_megatron_dispatch_moves_a_ranks_part_of_each_token():
    """Under sequence parallelism colozoo's MoE gathers the sequence and every tp rank dispatches whole tokens;
    Megatron-Core's all-to-all dispatcher sends 1/tp of those bytes (each token's slice of the hidden state, or the
    rank's own shard to folded experts). Without sequence parallelism, tp 1 or colozoo's own dispatcher: all of them.
    The exchange is priced on the bytes that travel: a gigabyte's all-to-all over 4 nodes takes a quarter as long."""
    from colozoo.cost.experts import dispatched_share, expert_exchange_seconds

    sp = Plan(tp=4, dp=8, ep=8, sequence_parallel=True)
    assert dispatched_share(sp, True) == 1 / 4
    assert dispatched_share(sp, False) == dispatched_share(Plan(tp=4, dp=8, ep=8), True) == 1.0
    assert dispatched_share(Plan(dp=8, ep=8), True) == 1.0
    comm, calls = {"ep.all_to_all": 4e9}, {"ep.all_to_all": 4}
    whole = expert_exchange_seconds(comm, calls, sp, H100)
    assert expert_exchange_seconds(comm, calls, sp, H100, share=1 / 4) == pytest.approx(whole / 4, rel=1e-3)


def test_grouped_expert_gemms_are_priced_per_expert():
    """torch._grouped_mm over 16 experts of 300 tokens each: (16, 300, n, k), each expert's rows filling three
    128-row tiles of cuBLAS's small tile at best (78%, at that tile's rate), slower than one GEMM of the 4800 tokens
    (by 9% on an H100); the weight gradient (a 3-D output) and other ops are not regrouped."""
    x, w = torch.empty(4800, 4096, device="meta"), torch.empty(16, 4096, 4096, device="meta")
    offs = torch.empty(16, dtype=torch.int32, device="meta")
    out = torch.empty(4800, 4096, device="meta")
    flops = 2 * 4800 * 4096 * 4096
    shape = grouped_gemm_shape("_grouped_mm", (x, w, offs), {}, out, flops)
    assert shape == (16, 300, 4096, 4096)
    assert grouped_gemm_shape("_grouped_mm", (x, w), {"offs": offs}, out, flops) == shape
    assert grouped_gemm_shape("_grouped_mm", (x, w), {}, torch.empty(16, 4096, 4096, device="meta"), flops) is None
    assert grouped_gemm_shape("mm", (x, w, offs), {}, out, flops) is None
    nbytes = 2 * (x.numel() + w.numel() + out.numel())
    assert gemm_seconds(flops, nbytes, shape, H100) > 1.08 * gemm_seconds(flops, nbytes, (1, 4800, 4096, 4096), H100)


def test_the_tracer_imports_no_pricing_module():
    """The tracer records shapes, FLOPs and bytes; pricing them (anything built on colozoo.cost.hardware) comes
    after it: none of the cost modules it imports, directly or through others, is one."""
    from test_architecture import graph

    edges, seen, todo = graph(), set(), ["colozoo.cost.trace"]
    while todo:
        for module in edges[todo.pop()] - seen:
            if module.startswith("colozoo.cost."):
                seen.add(module)
                todo.append(module)
    assert not seen & {"colozoo.cost.hardware", "colozoo.cost.experts"}, sorted(seen)


def test_reduce_window_of_the_interleaved_cool_down():
    """1F1B: the gradient reduction runs behind the last micro-batch's backward; interleaved over v = 4 with p = 16,
    behind the deeper virtual stages' last 16 micro-batches too: 1 + 16 x 3/4 backwards."""
    one = Plan(pp=16, num_microbatches=32, micro_batch_size=1)
    assert reduce_window(0.1, one) == pytest.approx(0.1)
    interleaved = Plan(pp=16, num_microbatches=32, micro_batch_size=1, schedule="interleaved_1f1b", virtual_stages=4)
    assert reduce_window(0.1, interleaved) == pytest.approx(0.1 * 13)


@pytest.fixture(scope="module")
def tiny_gpt_oss():
    from family_cases import tiny_kwargs

    return transformers.AutoConfig.for_model("gpt_oss", **tiny_kwargs("gpt_oss"))


def _layer(config, target: str, seq: int = 256) -> dict:
    from colozoo.cost.profiler import profile_for

    report = profile_for(config, batch_size=1, seq_len=seq, dtype="bfloat16", target=target)
    return next(u for u in report.units if u["layers"])


def test_attention_with_sinks_traced_as_the_fused_kernel(tiny_gpt_oss):
    """gpt-oss on the cuda target: its attention (sinks) is a fused kernel that keeps no (s, s) tensor per head (the
    sliding layers' mask, one (s, s) for all heads, stays); on the eager target every head's scores are saved."""
    fused, eager = _layer(tiny_gpt_oss, "cuda"), _layer(tiny_gpt_oss, "eager")
    assert any("|attention|" in k for k in fused["kernels"])
    assert not any("|attention|" in k for k in eager["kernels"])
    assert fused["attention_core_bytes"] * tiny_gpt_oss.num_attention_heads <= eager["attention_core_bytes"], \
        (fused["attention_core_bytes"], eager["attention_core_bytes"])


def test_traced_expert_gemms_are_grouped_per_expert(tiny_gpt_oss):
    """A traced bf16 MoE layer runs its experts as torch._grouped_mm: its forward GEMMs over the routed tokens are
    recorded one per expert, (experts, routed tokens / experts, n, k)."""
    c, seq = tiny_gpt_oss, 256
    experts, routed = c.num_local_experts, seq * c.num_experts_per_tok
    layer = _layer(c, "cuda", seq)
    shapes = [tuple(int(d) for d in k.split("|")[3].split("x")) for k in layer["kernels"]
              if k.startswith("fwd|gemm|")]
    assert (experts, routed // experts) in {s[:2] for s in shapes}, shapes


def test_model_flops_of_moe_and_causal_sources():
    """Megatron-Core's model FLOPs of a MoE step count the MLP once per expert a token runs (SwiGLU: 3/2), and a
    source counting the causal core's computed half counts s/2h for s/h."""
    from colozoo.cost.published import step_flops

    h, layers, heads, kv, ffn, vocab, batch, seq = 4096, 32, 32, 8, 14336, 32000, 256, 4096
    model = dict(family="mixtral", hidden=h, layers=layers, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab,
                 experts_per_token=2)
    dense_part = 12 * batch * seq * layers * h * h
    expected = dense_part * ((1 + kv / heads + seq / h) + 2 * ffn / h * 1.5 + vocab / (2 * layers * h))
    assert step_flops(model, batch, seq, "megatron_core") == pytest.approx(expected)
    causal = step_flops({**model, "flops": "causal"}, batch, seq, "megatron_core")
    assert expected - causal == pytest.approx(dense_part * seq / (2 * h))
