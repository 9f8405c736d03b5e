"""Grouped-query attention at tp larger than the kv heads (Megatron-Core's way): each tp rank holds its query heads
and ONE kv head, replicated over the tp / kv_heads ranks whose queries use it. Checked against transformers:
logits, loss and every gradient (the replicas' partial kv gradients summed), checkpoints that store each kv element
once and reload at other meshes bit for bit, the HF round trip, greedy generation, and a clipped training step."""
import json

import pytest
import torch
import transformers

from distributed import run_distributed
from parity import batch, causal_lm_parity, close, hf_causal_lm, hf_round_trip
from test_checkpoint import assert_bit_identical, hf_state
from test_generate import greedy_matches_transformers, ours_and_hf, prompts

import colozoo
from colozoo.checkpoint.convert import convert
from colozoo.checkpoint.format import INDEX_NAME
from colozoo.layers.shard import (ShardError, Split, gather_tensor, local_pieces, replicated_pieces, shard_tensor,
                                  stored_pieces)

TIMEOUT = 300
BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=32,
            pad_token_id=0)
KV2 = dict(BASE, num_attention_heads=8, num_key_value_heads=2, attention_bias=True)  # biases summed over replicas too
MQA = dict(BASE, num_attention_heads=4, num_key_value_heads=1)


def test_replicated_chunk_pieces():
    qkv = Split("tp", 0, chunks=(8, 2, 2), parts=(4, 1, 1))  # 4 query heads and 1 kv head of size 2
    assert [local_pieces(qkv, 12, r, 4)[0] for r in (0, 3)] == [[(0, 2, 0, 2), (8, 10, 2, 4), (10, 12, 4, 6)],
                                                                 [(6, 8, 0, 2), (8, 10, 2, 4), (10, 12, 4, 6)]]
    assert local_pieces(qkv, 12, 1, 2)[0] == [(4, 8, 0, 4), (8, 10, 4, 6), (10, 12, 6, 8)]
    assert local_pieces(qkv, 12, 0, 1)[0] == [(0, 8, 0, 8), (8, 10, 8, 10), (10, 12, 10, 12)]
    # only the first rank of a replica group stores the kv head: every element once over the tp ranks
    stored = [offsets[0] for r in range(4) for offsets, _, _ in stored_pieces((12, 3), (qkv,), {"tp": (r, 4)})]
    assert sorted(stored) == [0, 2, 4, 6, 8, 10]
    assert replicated_pieces((qkv,), {"tp": (1, 4)}) == [(0, 2, 4, 4, False), (0, 4, 6, 4, False)]
    assert replicated_pieces((qkv,), {"tp": (1, 1)}) == []
    assert Split.from_json(json.loads(json.dumps(qkv.to_json()))) == qkv
    full = torch.arange(36.0).view(12, 3)
    assert torch.equal(shard_tensor(full, (qkv,), {"tp": (2, 4)}), full[[4, 5, 8, 9, 10, 11]])
    with pytest.raises(ShardError, match="neither divisible"):
        local_pieces(Split("tp", 0, chunks=(8, 6, 6), parts=(4, 3, 3)), 20, 0, 4)
    with pytest.raises(ValueError, match="whole number of parts"):
        Split("tp", 0, chunks=(8, 3), parts=(4, 2))


def test_tp_neither_dividing_nor_a_multiple_of_the_kv_heads_is_a_clear_error():
    from colozoo.checkpoint.layout import check_mesh

    config = transformers.LlamaConfig(**dict(BASE, hidden_size=96, num_attention_heads=12, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"tp=4 must divide the key/value heads \(num_key_value_heads=3\)"):
        check_mesh(config, tp=4)
    check_mesh(transformers.LlamaConfig(**KV2), tp=4)


@pytest.mark.parametrize("config,tp,sp", [(KV2, 4, False), (KV2, 4, True), (MQA, 2, False), (MQA, 2, True),
                                          (MQA, 4, False), (MQA, 4, True)],
                         ids=["kv2-tp4", "kv2-tp4-sp", "mqa-tp2", "mqa-tp2-sp", "mqa-tp4", "mqa-tp4-sp"])
def test_llama_parity_with_replicated_kv_heads(config, tp, sp):
    run_distributed(causal_lm_parity, tp, model_type="llama", config_kwargs=config, tp=tp, sequence_parallel=sp,
                    timeout=TIMEOUT)


def test_mistral_sliding_window_with_one_kv_head_at_tp4():
    run_distributed(causal_lm_parity, 4, model_type="mistral", config_kwargs=dict(MQA, sliding_window=4), tp=4,
                    sequence_parallel=True, timeout=TIMEOUT)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_families_on_llama_attention_at_tp4_with_two_kv_heads(family):
    from family_parity import family_parity  # 4 query heads over 2 kv heads; Qwen2-MoE with qkv biases

    run_distributed(family_parity, 4, family=family, tp=4, sequence_parallel=True, timeout=TIMEOUT)


def test_pipeline_tp2_pp2_with_one_kv_head():
    from parity import pipeline_parity

    ids, mask, labels = batch(BASE["vocab_size"], 12)
    run_distributed(pipeline_parity, 4, architecture="LlamaForCausalLM", config_kwargs=dict(MQA, num_hidden_layers=4),
                    ids=ids, mask=mask, labels=labels, pp=2, tp=2, sequence_parallel=True, timeout=TIMEOUT)


def test_hf_round_trip_tp4():
    run_distributed(hf_round_trip, 4, model_type="llama", config_kwargs=KV2, tp=4, timeout=TIMEOUT)


def _load_and_save(path, out_colozoo, out_hf, tp):
    model = colozoo.from_pretrained(path, tp=tp)
    if out_colozoo is not None:
        model.save_pretrained(out_colozoo, format="colozoo")
    model.save_pretrained(out_hf, format="hf")
    return True


def test_checkpoint_saved_at_tp4_stores_kv_once_and_reloads_at_tp1_and_tp2(tmp_path):
    config = transformers.LlamaConfig(**KV2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    run_distributed(_load_and_save, 4, path=tmp_path / "hf", out_colozoo=tmp_path / "tp4",
                    out_hf=tmp_path / "tp4_hf", tp=4, timeout=TIMEOUT)
    reference = hf_state(tmp_path / "hf")
    assert_bit_identical(reference, hf_state(tmp_path / "tp4_hf"))

    index = json.loads((tmp_path / "tp4" / INDEX_NAME).read_text())
    hd, rows = 8, (8 + 2 + 2) * 8
    for name in ("layers.0.self_attn.qkv.weight", "layers.1.self_attn.qkv.bias"):
        entry = index["tensors"][name]
        assert entry["spec"][0]["parts"] == [8, 2, 2]
        covered = torch.zeros(rows, dtype=torch.long)
        for piece in entry["pieces"]:
            covered[piece["offsets"][0]:piece["offsets"][0] + piece["shape"][0]] += 1
        assert covered.eq(1).all(), covered  # every element stored once, none twice
        # the kv heads (rows 64.., one per pair of ranks) lie in the files of tp ranks 0 and 2 only
        kv_files = {p["file"] for p in entry["pieces"] if p["offsets"][0] >= 8 * hd}
        assert {f.split("-")[2] for f in kv_files} == {"tp00", "tp02"}
    convert(tmp_path / "hf", tmp_path / "tp4_offline", tp=4)  # the offline converter writes the same pieces
    offline = json.loads((tmp_path / "tp4_offline" / INDEX_NAME).read_text())
    assert {n: e["pieces"] for n, e in offline["tensors"].items()} == {n: e["pieces"] for n, e in index["tensors"].items()}

    _load_and_save(tmp_path / "tp4", None, tmp_path / "tp1_hf", tp=1)
    assert_bit_identical(reference, hf_state(tmp_path / "tp1_hf"))
    run_distributed(_load_and_save, 2, path=tmp_path / "tp4", out_colozoo=None, out_hf=tmp_path / "tp2_hf", tp=2,
                    timeout=TIMEOUT)
    assert_bit_identical(reference, hf_state(tmp_path / "tp2_hf"))


def _generate_and_cache(tp):
    tokens = greedy_matches_transformers(["llama"], tp=tp)  # test_generate's llama: 4 heads, 2 kv heads
    from colozoo.core.mesh import init_parallel

    config, hf, model = ours_and_hf("llama", init_parallel(tp=tp))
    ids, mask = prompts(config.vocab_size)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, eos_token_id=None,
                         return_dict_in_generate=True)
    head_dim = config.hidden_size // config.num_attention_heads
    one_head = 2 * config.num_hidden_layers * 1 * head_dim * (ids.shape[1] + 3) * ids.shape[0]
    return tokens, out.cache_elements, one_head


def test_greedy_generate_tp4_with_two_kv_heads():
    results = run_distributed(_generate_and_cache, 4, tp=4, timeout=TIMEOUT)
    assert all(tokens == results[0][0] for tokens, _, _ in results)
    assert all(got == one_head for _, got, one_head in results)  # each rank caches its one kv head


LR, EPS, MAX_NORM = 1e-3, 1e-6, 0.5
PARAM_ATOL = 2e-6


def train_step_against_hf(tp, dp=1, config_kwargs=KV2):
    """One forward_backward (2 micro-batches) + clipping + AdamW at `tp` (and FSDP over `dp`) against transformers
    on one process: the global norm, every updated parameter, and the kv-head replicas bitwise identical after."""
    import torch.distributed as dist

    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
    from colozoo.converters import family_module
    from colozoo.core.mesh import coords_of, init_parallel
    from colozoo.layers.shard import spec_of
    from colozoo.runtime.training import build_optimizer, clip_grad_norm_, parallelize

    parallel = init_parallel(tp=tp, dp=dp)
    config, hf = hf_causal_lm("llama", config_kwargs)
    hf.train()
    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    model.train()
    parallelize(model)
    optimizer = build_optimizer(model, lr=LR, eps=EPS)
    hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=LR, eps=EPS)
    ids, mask, labels = batch(config.vocab_size, 12, batch_size=4)

    loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
    norm = clip_grad_norm_(model, MAX_NORM)
    ref = hf(ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM)
    assert ref_norm > MAX_NORM, "the step must really clip"
    close(loss, ref, 1e-5, "loss")
    close(norm, ref_norm, 1e-6, "global gradient norm (replicated kv heads counted once)")
    optimizer.step()
    hf_optimizer.step()

    sources, coords = family_module("llama").hf_sources(config), coords_of(parallel)
    weights = StateDictReader(hf.state_dict())
    replicas_equal = []
    for name, p in model.named_parameters():
        expected = GlobalTensor(weights, sources[name], name).read()
        spec, p = spec_of(p), p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP: the dp shards first
        close(gather_tensor(p.detach(), spec, expected.shape, parallel.groups, coords), expected, PARAM_ATOL,
              f"parameter {name} after the step")
        for dim, l0, l1, replicas, _ in replicated_pieces(spec, coords):
            gathered = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(gathered, p.detach().contiguous(), group=parallel.tp_group)
            rows = [g.narrow(dim, l0, l1 - l0) for g in gathered]
            replicas_equal.append(all(torch.equal(rows[r], rows[r - r % replicas]) for r in range(tp)))
    return replicas_equal


def test_clipped_training_step_tp4_equals_one_process():
    results = run_distributed(train_step_against_hf, 4, tp=4, timeout=TIMEOUT)
    assert all(r and all(r) for r in results)


def test_clipped_training_step_tp2_fsdp2_with_one_kv_head_equals_one_process():
    # FSDP shards each tp-local qkv over the data ranks: clipping finds the replicated rows in its shard
    results = run_distributed(train_step_against_hf, 4, tp=2, dp=2, config_kwargs=MQA, timeout=TIMEOUT)
    assert all(r and all(r) for r in results)
