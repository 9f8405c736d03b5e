"""Context parallelism: ring and all-to-all attention equal full attention (outputs and q/k/v gradients), and
GPT-2 sharded over cp (with tp) matches transformers in logits, loss and gradients."""
import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from family_cases import tiny_kwargs
from parity import batch, close, global_shapes, hf_causal_lm, resolved_sources

ATOL = 1e-5


def _inputs(seed=0, b=2, hq=4, hk=2, s=16, d=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g) for h in (hq, hk, hk, hq))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, :5] = 0       # left padding: early rows see no key at all
    mask[1, s - 3:] = 0   # right padding
    return q, k, v, dout, mask


def _reference(q, k, v, dout, mask, causal, window):
    """Whole-sequence attention written out here in fp64, its mask built directly from the positions: independent
    of the code under test (rows that see no key give zeros, as the cp modes do)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    s, groups = q.shape[2], q.shape[1] // k.shape[1]
    query, key = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed &= key <= query
    if window is not None:
        allowed &= query - key < window
    allowed = allowed[None, None] & (mask.bool()[:, None, None, :] if mask is not None else True)
    seen = allowed.any(-1, keepdim=True)
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")).masked_fill(~seen, 0.0), -1) * seen
    out = probs @ v.repeat_interleave(groups, 1)
    out.backward(dout.double())
    return tuple(t.float() for t in (out.detach(), q.grad, k.grad, v.grad))


def cp_attention_matches(cp_size, mode):
    from unittest import mock

    from colozoo.layers import context_parallel
    from colozoo.layers.attention import attention
    from colozoo.layers.context_parallel import ContextParallel, gather_sequence, shard_sequence
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(cp=cp_size)
    group = parallel.group("cp")
    q, k, v, dout, full_padding = _inputs()
    worst = {}
    for causal in (True, False):
        for padded in (False, True):
            for window in (None, 6):
                mask = full_padding if padded else None
                ref = _reference(q, k, v, dout, mask, causal, window)
                cp = ContextParallel(group, mode, q.shape[2], mask)
                local = [shard_sequence(t, group, dim=2).requires_grad_() for t in (q, k, v)]
                with mock.patch.object(context_parallel, "QUERY_CHUNK", 4):  # Ulysses' masks in 3 query chunks
                    out = attention(*local, causal=causal, cp=cp, window=window)
                out.backward(shard_sequence(dout, group, dim=2))
                got = [gather_sequence(out.detach(), group, dim=2)] + [gather_sequence(t.grad, group, dim=2)
                                                                        for t in local]
                case = f"causal={causal} padded={padded} window={window}"
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
                    close(a, b, ATOL, f"{mode} cp={cp_size} {case}: {name}")
                    diff = (a - b).abs().max().item()
                    worst[name] = max(worst.get(name, 0.0), diff)
    return worst


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_cp_attention_equals_full_attention(cp, mode):
    run_distributed(cp_attention_matches, cp, cp_size=cp, mode=mode, timeout=120)


def test_zigzag_shard_and_gather_round_trip():
    from colozoo.layers.context_parallel import zigzag_index, zigzag_order

    assert zigzag_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(zigzag_order(24, 3).tolist()) == list(range(24))
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        zigzag_index(10, 4, 0)


FAMILIES = {family: tiny_kwargs(family) for family in ("gpt2", "opt", "llama", "mistral")}  # the declared configs


def right_padded_batch(vocab_size: int, seq_len: int, padding: int = 6):
    """Right padding with labels on it too (as when pad = eos), so the loss reads the padded positions."""
    ids, _, _ = batch(vocab_size, seq_len, padded=False)
    mask = torch.ones_like(ids)
    mask[0, seq_len - padding:] = 0  # 6: padding on both cp ranks' shares (zigzag chunks of 4)
    mask[1, seq_len - 1:] = 0
    return ids, mask, ids


def cp_parity(tp, cp, mode, sequence_parallel=False, family="gpt2", overrides=None, right_padding: int = 0,
              attn_implementation: str = "sdpa"):
    """Context parallel against transformers: logits, loss and every gradient (summed over the cp ranks). With
    `right_padding`, the first sequence ends in that many padded positions that carry labels."""
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
    from colozoo.layers.shard import gather_tensor, spec_of
    from colozoo.api import build_model
    from colozoo.core.mesh import coords_of, init_parallel

    parallel = init_parallel(tp=tp, cp=cp, sequence_parallel=sequence_parallel)
    config, hf = hf_causal_lm(family, tiny_kwargs(family, **(overrides or {})), attn_implementation=attn_implementation)
    if right_padding:
        ids, mask, labels = right_padded_batch(config.vocab_size, 16, right_padding)
    else:
        ids, mask, labels = batch(config.vocab_size, 16)
    ref = hf(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})

    model = build_model(config, parallel=parallel, device="meta")
    weights = StateDictReader(hf.state_dict())
    load_hf_weights(model, weights, device="cpu")
    model.eval()
    out = model(ids, attention_mask=mask, labels=labels, return_logits=True, cp_mode=mode)
    out.loss.backward()
    keep = mask.bool()
    close(out.logits[keep], ref.logits[keep], ATOL, "logits")
    close(out.loss, ref.loss, ATOL, "loss")

    sources = resolved_sources(model, weights)  # as the loader read them (in-memory names: GPT-NeoX's lm_head)
    shapes = global_shapes(model, sources, weights)
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=parallel.group("cp"))  # each cp rank holds its share of every gradient
        full = gather_tensor(grad, spec_of(p), shapes[name], parallel.groups, coords_of(parallel))
        expected = GlobalTensor(hf_grads, sources[name], name).read()
        close(full, expected, ATOL, f"gradient of {name}")
        diff = (full - expected).abs().max().item()
        worst = max(worst, diff)
    return worst


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_gpt2_cp2_matches_transformers(mode):
    run_distributed(cp_parity, 2, tp=1, cp=2, mode=mode, timeout=120)


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_gpt2_cp2_tp2_matches_transformers(mode):
    run_distributed(cp_parity, 4, tp=2, cp=2, mode=mode, sequence_parallel=True, timeout=150)


def test_gpt2_cp4_ring_matches_transformers():
    run_distributed(cp_parity, 4, tp=1, cp=4, mode="ring", timeout=150)


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_gpt2_cp4_tp2_matches_transformers(mode):
    # 8 ranks; 8 heads, so all-to-all spreads each tp rank's 4 heads over the 4 cp ranks
    run_distributed(cp_parity, 8, tp=2, cp=4, mode=mode, sequence_parallel=True, family="gpt2",
                    overrides=dict(n_head=8), timeout=240)


@pytest.mark.parametrize("family", ["opt", "llama", "mistral"])
def test_other_families_cp2_tp2_match_transformers(family):
    # OPT: positions counted over the padding mask before sharding; LLaMA: RoPE at the rank's positions;
    # Mistral: sliding window across ring blocks
    run_distributed(cp_parity, 4, tp=2, cp=2, mode="ring", sequence_parallel=True, family=family, timeout=150)


def ring_bf16_close(cp_size):
    from colozoo.layers.attention import attention
    from colozoo.layers.context_parallel import ContextParallel, gather_sequence, shard_sequence
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(cp=cp_size)
    q, k, v, dout, mask = (t.bfloat16().float() if t.is_floating_point() else t for t in _inputs())
    ref = _reference(q, k, v, dout, mask, True, None)  # on the inputs the ring sees, in fp64
    cp = ContextParallel(parallel.group("cp"), "ring", q.shape[2], mask)
    local = [shard_sequence(t.bfloat16(), parallel.group("cp"), dim=2).requires_grad_() for t in (q, k, v)]
    out = attention(*local, causal=True, cp=cp)
    out.backward(shard_sequence(dout.bfloat16(), parallel.group("cp"), dim=2))
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in local)
    got = [gather_sequence(out.detach(), parallel.group("cp"), dim=2)] + [gather_sequence(t.grad, parallel.group("cp"),
                                                                                          dim=2)
                                                                    for t in local]
    # computed in fp32 and rounded once to bf16: within one bf16 ulp (2^-8 relative) of the exact result; blocks
    # computed in bf16 would be several ulps off
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a.float(), b, rtol=2 ** -8, atol=1e-6, msg=lambda m: f"bf16 ring {name}: {m}")


def test_ring_attention_bf16():
    run_distributed(ring_bf16_close, 2, cp_size=2, timeout=180)


def cp_pipeline_forward_parity(family, mode):
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(pp=2, cp=2)
    config, hf = hf_causal_lm(family, FAMILIES[family])
    ids, mask, labels = batch(config.vocab_size, 16)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, labels=labels)
    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    model.eval()
    with torch.no_grad():  # a pipeline evaluates without gradients
        out = model(ids, attention_mask=mask, labels=labels, cp_mode=mode)
    close(out.logits[mask.bool()], ref.logits[mask.bool()], ATOL, "logits")
    close(out.loss, ref.loss, ATOL, "loss")


@pytest.mark.parametrize("family,mode", [("gpt2", "ring"), ("llama", "all_to_all")])
def test_cp2_with_pipeline_pp2_forward(family, mode):
    run_distributed(cp_pipeline_forward_parity, 4, family=family, mode=mode, timeout=150)


def cp_errors():
    from colozoo.layers.attention import attention
    from colozoo.layers.context_parallel import ContextParallel
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(cp=2)
    config, _ = hf_causal_lm("gpt2", FAMILIES["gpt2"])
    model = build_model(config, parallel=parallel)
    with pytest.raises(ValueError, match=r"sequence length \(10\) divisible by 2\*cp = 4"):
        model(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="cp_mode must be one of"):
        model(torch.zeros(1, 8, dtype=torch.long), cp_mode="ulysses")
    q = torch.zeros(1, 3, 4, 8)
    with pytest.raises(ValueError, match=r"local attention heads \(3\) divisible by cp=2"):
        attention(q, q, q, causal=True, cp=ContextParallel(parallel.group("cp"), "all_to_all", 8, None))
    with pytest.raises(ValueError, match="dropout is not supported with cp_mode='ring'"):
        attention(q, q, q, causal=True, dropout_p=0.1, cp=ContextParallel(parallel.group("cp"), "ring", 8, None))


def test_context_parallel_errors_name_the_problem():
    run_distributed(cp_errors, 2, timeout=60)


def cp_builds_no_dense_mask(family, builder):
    """Under cp the (batch, 1, S, S) mask of the full sequence is never built (it grows with S squared)."""
    from unittest import mock

    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(cp=2)
    config, _ = hf_causal_lm(family, FAMILIES[family])
    model = build_model(config, parallel=parallel).eval()
    ids, mask, labels = batch(config.vocab_size, 16)
    with mock.patch(builder, side_effect=AssertionError("a dense (S, S) mask was built under cp")):
        for mode in ("ring", "all_to_all"):
            model(ids, attention_mask=mask, labels=labels, cp_mode=mode)


@pytest.mark.parametrize("family,builder", [("gpt2", "colozoo.layers.batch.dense_attention_mask"),
                                            ("opt", "colozoo.layers.batch.dense_attention_mask"),
                                            ("mistral", "colozoo.layers.batch.dense_attention_mask")])
def test_cp_never_builds_the_dense_mask(family, builder):
    run_distributed(cp_builds_no_dense_mask, 2, family=family, builder=builder, timeout=90)


def ulysses_padding_parity(family):
    """Padding under all-to-all: logits, loss and gradients are transformers' (which cp=1 matches), with masks of
    a chunk of queries at the most (QUERY_CHUNK, here 4 of 16) reaching the attention core, never (S, S)."""
    from unittest import mock

    from colozoo.layers import context_parallel

    core, masks = context_parallel.local_attention, []

    def recording(q, k, v, mask=None, **kwargs):
        masks.append(mask)
        return core(q, k, v, mask, **kwargs)

    dense = AssertionError("the (S, S) mask of the whole sequence was built")
    with mock.patch.object(context_parallel, "local_attention", recording), \
            mock.patch.object(context_parallel, "QUERY_CHUNK", 4), \
            mock.patch.object(context_parallel, "full_mask", side_effect=dense):
        cp_parity(1, 2, "all_to_all", family=family, right_padding=6)
        cp_parity(1, 2, "all_to_all", family=family)  # left padding
    shapes = [tuple(m.shape) for m in masks if m is not None]
    assert shapes and all(shape[-2] <= 4 for shape in shapes), shapes


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_ulysses_padding_never_builds_the_whole_mask(family):
    run_distributed(ulysses_padding_parity, 2, family=family, timeout=120)


def add_large_score_offset(hf_gpt2, offset: float = 1000.0):
    """Give every head's scores a per-query constant near `offset` (softmax ignores it): the first coordinate of
    each head's q gets +offset and that of k becomes 1. Rounded to bf16 (spacing 4 to 8 there) the scores lose
    their differences, which only fp32 scores (GPT-2's reorder_and_upcast_attn) keep."""
    h = hf_gpt2.config.n_embd
    first = torch.arange(0, h, h // hf_gpt2.config.n_head)
    with torch.no_grad():
        for block in hf_gpt2.transformer.h:
            weight, bias = block.attn.c_attn.weight, block.attn.c_attn.bias  # Conv1D: (h, 3h), q | k | v
            bias[first] += offset
            weight[:, h + first] = 0.0
            bias[h + first] = 1.0


def gpt2_upcast_ring_matches_cp1_bf16():
    """bf16 GPT-2 with reorder_and_upcast_attn: the ring's logits are cp=1's to a few roundings, a tolerance that
    attention with bf16 scores (transformers' eager path without the option) misses by far."""
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    options = {**FAMILIES["gpt2"], "reorder_and_upcast_attn": True, "initializer_range": 0.1}
    config, hf = hf_causal_lm("gpt2", options, attn_implementation="eager")
    _, hf_off = hf_causal_lm("gpt2", {**options, "reorder_and_upcast_attn": False}, attn_implementation="eager")
    add_large_score_offset(hf)
    hf_off.load_state_dict(hf.state_dict())
    hf, hf_off = hf.to(torch.bfloat16), hf_off.to(torch.bfloat16)
    ids, mask, _ = batch(config.vocab_size, 16)
    keep = mask.bool()
    logits = {}
    with torch.no_grad():
        for cp in (1, 2):
            model = build_model(config, parallel=init_parallel(cp=cp), device="meta", dtype=torch.bfloat16)
            load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
            logits[cp] = model.eval()(ids, attention_mask=mask, return_logits=True).logits.float()
        without_upcast = hf_off(ids, attention_mask=mask).logits.float()
    atol = 4 * torch.finfo(torch.bfloat16).eps / 2 * logits[1][keep].abs().max().item()  # 4 roundings of the top

    def diff(a, b):
        return (a - b)[keep].abs().max().item()

    assert diff(logits[2], logits[1]) <= atol, f"ring logits differ from cp=1 by {diff(logits[2], logits[1])} > {atol}"
    assert diff(without_upcast, logits[1]) > 4 * atol, "the test cannot tell reorder_and_upcast_attn on from off"
    return diff(logits[2], logits[1]), diff(without_upcast, logits[1]), atol


def test_gpt2_upcast_attention_on_the_ring_bf16():
    run_distributed(gpt2_upcast_ring_matches_cp1_bf16, 2, timeout=120)
