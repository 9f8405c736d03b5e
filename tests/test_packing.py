"""Packed sequences: with position_ids that restart, no attention_mask and no KV cache, a token attends only to
earlier tokens of its own document (transformers' convention, masking_utils.find_packed_sequence_indices).

Parity: every family against transformers on a packed batch (logits, loss, gradients at tp 1 and 2). transformers
packs only without a cache, so its reference runs with use_cache=False (its default builds a cache even in a plain
forward, and then it ignores the packing). Leakage: on every attention path (torch, the flash kernel, tp2 with
sequence parallelism, pp2, cp2 ring and all-to-all, sliding windows, Gemma's soft-capping) each document's logits
and loss in the packed batch equal those of the document run on its own, and changing a token of one document
moves no other document's logits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from family_cases import CAUSAL, attention, tiny_kwargs
from parity import close, hf_causal_lm

ATOL = 1e-5
# every causal family of the table, its declared config (windows shorter than the documents); variants not for parity
VARIANTS = {"gpt2_upcast": ("gpt2", tiny_kwargs("gpt2", reorder_and_upcast_attn=True), "eager"),
            "phi3_plain_rope": ("phi3", tiny_kwargs("phi3", rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 10000.0}), "sdpa")}


def hf_reference(name: str):
    """(config, transformers model) of a family of the table or of VARIANTS."""
    model_type, config, attn = VARIANTS.get(name) or (name, tiny_kwargs(name), attention(name))
    return hf_causal_lm(model_type, config, attn_implementation=attn)


# (row, first token, length) of every document of the packed batch; row 1 opens with the tail of a document
# that began in an earlier batch (positions 3..11), so a document need not start at position 0
DOCUMENTS = [(0, 0, 5), (0, 5, 7), (0, 12, 4), (1, 0, 9), (1, 9, 7)]
SEQ = 16


def packed_batch(vocab_size: int, seed: int = 1):
    """(ids, position_ids) of two rows of 16 tokens packing DOCUMENTS."""
    ids = torch.randint(0, vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    positions = torch.zeros(2, SEQ, dtype=torch.long)
    for row, start, length in DOCUMENTS:
        positions[row, start:start + length] = torch.arange(length) + (3 if (row, start) == (1, 0) else 0)
    return ids, positions


def build(parallel, hf):
    """Our model on `parallel` with `hf`'s weights, and the sources its gradients compare by (family_parity.load)."""
    from family_parity import load

    model, sources = load(hf, hf.config, parallel)
    return model.eval(), sources


def gradients_match(model, parallel, sources, hf_grads):
    """Every gradient, gathered (over FSDP's shards, then tp), equals transformers' (by its in-memory names); a frozen
    parameter has none."""
    from colozoo.checkpoint.readers import GlobalTensor
    from colozoo.core.mesh import coords_of
    from colozoo.layers.shard import gather_tensor, spec_of

    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"frozen {name} got a gradient"
            continue
        expected = GlobalTensor(hf_grads, sources[name], name).read()
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        scale = max(1.0, expected.abs().max().item())
        close(gather_tensor(grad, spec_of(p), expected.shape, parallel.groups, coords_of(parallel)), expected,
              ATOL * scale,
              f"gradient of {name}")


def document_loss(logits, ids):
    """The mean next-token loss within one document: (length, vocab) logits, (length,) ids."""
    return F.cross_entropy(logits[:-1].float(), ids[1:])


# transformers' OPT builds its causal mask without position_ids, so it never packs, and its gpt-oss's packed logits
# differ from its documents run alone (ours equal them: test_no_leakage_sliding_window): there the reference is every
# document run alone, its logits stitched back into the batch (without the router loss, which needs the whole batch)
UNPACKED_IN_TRANSFORMERS = ("opt", "gpt_oss")


def rotates_by_row_length(config) -> bool:
    """LongRoPE (Phi-3) picks its short or long factors by the length of the whole row, in transformers as in
    colozoo: a packed document is not rotated as the same document alone."""
    from colozoo.layers.rope import rope_parameters

    return rope_parameters(config)["rope_type"] == "longrope"


def stitched_reference(hf, ids, positions):
    """transformers' logits of every document run on its own, in the packed batch's layout, and their loss."""
    rows = [[] for _ in range(ids.shape[0])]
    for row, start, length in DOCUMENTS:
        doc = slice(start, start + length)
        rows[row].append(hf(ids[row:row + 1, doc], position_ids=positions[row:row + 1, doc], use_cache=False).logits)
    logits = torch.cat([torch.cat(r, dim=1) for r in rows])
    return logits, F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def packed_parity(family: str, tp: int = 1, sequence_parallel: bool = False):
    """Logits, loss and every gradient of a packed batch against transformers; transformers is first checked to
    honour the packing itself (a document's logits equal those of the document run alone)."""
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(tp=tp, sequence_parallel=sequence_parallel)
    config, hf = hf_reference(family)
    ids, positions = packed_batch(config.vocab_size)
    ref = hf(ids, position_ids=positions, labels=ids, use_cache=False)
    stitched, stitched_loss = stitched_reference(hf, ids, positions)
    options = {}
    if family in UNPACKED_IN_TRANSFORMERS:
        assert not torch.allclose(ref.logits, stitched, atol=1e-3), f"transformers' {family} packs after all"
        ref.logits, ref.loss = stitched, stitched_loss
        options = {"output_router_logits": False} if getattr(config, "output_router_logits", False) else {}
    elif not rotates_by_row_length(config):
        close(ref.logits, stitched, ATOL, f"transformers' {family} packed logits against its documents alone")
    hf.zero_grad()
    ref.loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})

    model, sources = build(parallel, hf)
    out = model(ids, position_ids=positions, labels=ids, return_logits=True, **options)
    close(out.logits, ref.logits, ATOL, "logits")
    close(out.loss, ref.loss, ATOL, "loss")
    out.loss.backward()
    return gradients_match(model, parallel, sources, hf_grads)


FAMILIES = CAUSAL


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_parity_tp1(family):
    packed_parity(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_parity_tp2(family):
    run_distributed(packed_parity, 2, family=family, tp=2, sequence_parallel=False, timeout=300)


def no_leakage(family: str = "llama", tp: int = 1, sequence_parallel: bool = False, pp: int = 1, cp: int = 1,
               cp_mode: str = "ring", kernels: str | None = None, train: bool = True):
    """Each document's logits and loss in the packed batch equal transformers' on the document alone (so nothing
    crosses a document boundary), on the path the mesh and `kernels` select; with `train`, forward_backward over
    two micro-batches gives transformers' packed loss and gradients."""
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel
    from colozoo.kernels.dispatch import use_kernels
    from colozoo.runtime.training import parallelize

    parallel = init_parallel(tp=tp, pp=pp, cp=cp, sequence_parallel=sequence_parallel)
    config, hf = hf_reference(family)
    ids, positions = packed_batch(config.vocab_size)
    model, sources = build(parallel, hf)
    with use_kernels(kernels):
        out = model(ids, position_ids=positions, return_logits=True, cp_mode=cp_mode)
    for row, start, length in DOCUMENTS:
        doc = slice(start, start + length)
        alone = hf(ids[row:row + 1, doc], position_ids=positions[row:row + 1, doc], use_cache=False).logits[0]
        what = f"document {start}..{start + length - 1} of row {row}"
        close(out.logits[row, doc], alone, ATOL, f"{what}: logits")
        close(document_loss(out.logits[row, doc], ids[row, doc]), document_loss(alone, ids[row, doc]), ATOL,
              f"{what}: loss")
    if not train:
        return None
    ref = hf(ids, position_ids=positions, labels=ids, use_cache=False)
    ref.loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})
    parallelize(model)
    with use_kernels(kernels):
        loss = model.forward_backward(ids, ids, position_ids=positions, num_microbatches=2, cp_mode=cp_mode)
    close(loss, ref.loss, ATOL, "forward_backward loss")
    return gradients_match(model, parallel, sources, hf_grads)


def test_no_leakage_torch_path():
    no_leakage("llama", kernels="torch")


def test_no_leakage_tp2_sequence_parallel():
    run_distributed(no_leakage, 2, family="llama", tp=2, sequence_parallel=True, timeout=300)


def test_no_leakage_pp2():
    run_distributed(no_leakage, 2, family="llama", pp=2, timeout=300)


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_no_leakage_cp2(mode):
    run_distributed(no_leakage, 2, family="llama", cp=2, cp_mode=mode, timeout=300)


def ulysses_masks_stay_chunked():
    """Packed all-to-all attention masks chunks of queries (QUERY_CHUNK, here 4 of 16), never (S, S)."""
    from unittest import mock

    from colozoo.layers import context_parallel

    core, shapes = context_parallel.local_attention, []

    def recording(q, k, v, mask=None, **kwargs):
        shapes.append(None if mask is None else tuple(mask.shape))
        return core(q, k, v, mask, **kwargs)

    with mock.patch.object(context_parallel, "local_attention", recording), \
            mock.patch.object(context_parallel, "QUERY_CHUNK", 4):
        no_leakage("llama", cp=2, cp_mode="all_to_all", train=False)
    assert shapes and all(s is not None and s[2] <= 4 for s in shapes), shapes


def test_no_leakage_cp2_all_to_all_masks_chunks():
    run_distributed(ulysses_masks_stay_chunked, 2, timeout=300)


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_no_leakage_cp2_sliding_window_tp2(mode):
    """Mistral's window (4) is shorter than the documents (up to 9), over 2 cp x 2 tp ranks."""
    run_distributed(no_leakage, 4, family="mistral", tp=2, sequence_parallel=True, cp=2, cp_mode=mode, timeout=300)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3_text", "phi3_plain_rope", "gpt_oss"])
def test_no_leakage_sliding_window(family):
    no_leakage(family, train=False)


def test_no_leakage_gemma2_softcap():
    no_leakage("gemma2")


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_no_leakage_gemma2_softcap_cp2(mode):
    run_distributed(no_leakage, 2, family="gemma2", cp=2, cp_mode=mode, train=False, timeout=300)


def test_no_leakage_gpt2_upcast():
    """GPT-2's reorder_and_upcast_attn path (scores in fp32, its own masking)."""
    no_leakage("gpt2_upcast", train=False)


def changed_token_moves_only_its_document(family: str = "llama", kernels: str | None = None):
    """Change one token of document 1 of row 0: its own later logits move, documents 0 and 2 do not."""
    from colozoo.core.mesh import init_parallel
    from colozoo.kernels.dispatch import use_kernels

    config, hf = hf_reference(family)
    model, _ = build(init_parallel(), hf)
    ids, positions = packed_batch(config.vocab_size)
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % config.vocab_size
    with use_kernels(kernels), torch.no_grad():
        before = model(ids, position_ids=positions, return_logits=True).logits
        after = model(changed, position_ids=positions, return_logits=True).logits
    assert (after[0, 6:12] - before[0, 6:12]).abs().max() > 1e-3, "the changed document's logits did not move"
    close(after[0, 12:], before[0, 12:], 0.0, "the next document's logits")
    close(after[:, :5], before[:, :5], 0.0, "the first document's logits")
    close(after[1], before[1], 0.0, "the other row's logits")
    # the same batch without position_ids is one document per row: there the change does reach the next tokens
    with use_kernels(kernels), torch.no_grad():
        joined = model(changed, return_logits=True).logits - model(ids, return_logits=True).logits
    assert joined[0, 12:].abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "gpt_neox"])
def test_changed_token_moves_only_its_document(family):
    changed_token_moves_only_its_document(family)


def test_documents_follow_transformers():
    from transformers.masking_utils import find_packed_sequence_indices

    from colozoo.layers.documents import packed_documents

    ids, positions = packed_batch(101)
    assert torch.equal(packed_documents(positions), find_packed_sequence_indices(positions).int())
    assert packed_documents(torch.arange(SEQ).expand(2, SEQ) + 4) is None  # continuous: nothing to mask
    assert find_packed_sequence_indices(torch.arange(SEQ).expand(2, SEQ) + 4) is None


def test_attention_mask_or_cache_turns_packing_off():
    """transformers packs only without an attention_mask and without a KV cache; so do we."""
    from colozoo.core.mesh import init_parallel

    config, hf = hf_reference("llama")
    model, _ = build(init_parallel(), hf)
    ids, positions = packed_batch(config.vocab_size)
    batch = model.batch_context(ids, None, position_ids=positions)
    assert batch.documents is not None
    assert model.batch_context(ids, torch.ones_like(ids), position_ids=positions).documents is None
    batch = model.batch_context(ids, None, position_ids=positions)
    batch.cache = object()
    assert batch.documents is None
    with torch.no_grad():
        ours = model(ids, attention_mask=torch.ones_like(ids), position_ids=positions, return_logits=True).logits
        theirs = hf(ids, attention_mask=torch.ones_like(ids), position_ids=positions, use_cache=False).logits
    close(ours, theirs, ATOL, "logits with an attention mask (no packing)")


# ------------------------------------------------------------------------------ the flash kernel (Triton interpreter)

def _kernels():
    pytest.importorskip("triton")
    import test_kernels  # sets TRITON_INTERPRET=1 on CPU before any kernel module is (re)loaded
    from test_kernels_in_models import KERNEL_MODULES

    if test_kernels.CUDA:
        pytest.skip("the HF harness runs on CPU")
    for name in KERNEL_MODULES:
        test_kernels.kernel_module(name)
    return test_kernels


@pytest.mark.parametrize("case", ["causal_padded_gqa", "causal_multiblock_mqa", "padded_bidirectional"])
def test_flash_attention_documents(case):
    """The kernel's document comparison, forward and backward, against the reference; several documents in each
    row (blocks of 16 queries straddle their boundaries), with padding where the case has it."""
    tk = _kernels()
    fa = tk.kernel_module("attention_triton")
    b, h, hk, sq, sk, d, causal, padded = tk.ATTENTION_CASES[case]
    mask = None
    if padded:
        keep = torch.ones(b, sk, dtype=torch.bool)
        keep[-1, sk - 2:] = False
        mask = keep[:, None, None, :]
    starts = torch.zeros(b, sq, dtype=torch.int32)
    starts[:, [i for i in (4, 11, 30, 31, 50) if i < sq]] = 1
    starts[-1, sq // 2] = 1
    documents = starts.cumsum(-1, dtype=torch.int32)
    tensors = [tk.randn(b, h, sq, d, seed=1), tk.randn(b, hk, sk, d, seed=2), tk.randn(b, hk, sk, d, seed=3)]
    packed = tk.flash_attention_reference(*tensors, mask, causal=causal, documents=documents)
    assert (packed - tk.flash_attention_reference(*tensors, mask, causal=causal)).abs().max() > 0.05
    for dtype in (torch.float32, torch.float16):
        tk.check(lambda q, k, v: fa.flash_attention_triton(q, k, v, mask, causal=causal, scale=0.3,
                                                           documents=documents),
                 lambda q, k, v: tk.flash_attention_reference(q, k, v, mask, causal=causal, scale=0.3,
                                                              documents=documents),
                 dtype, tensors, f"packed flash attention {case}")


def test_no_leakage_flash_kernel(monkeypatch):
    """LLaMA packed on the Triton path (interpreted, fp32): the flash kernel is handed the document ids."""
    tk = _kernels()
    calls = []
    fa = tk.kernel_module("attention_triton")
    original = fa.flash_attention_triton
    monkeypatch.setattr(fa, "flash_attention_triton",
                        lambda *a, **k: calls.append(k.get("documents") is not None) or original(*a, **k))
    no_leakage("llama", kernels="triton", train=False)
    assert calls and all(calls), f"flash kernel calls with document ids: {calls}"


def test_no_leakage_flash_kernel_gemma2_softcap():
    _kernels()
    no_leakage("gemma2", kernels="triton", train=False)


def test_changed_token_flash_kernel():
    _kernels()
    changed_token_moves_only_its_document("llama", kernels="triton")
