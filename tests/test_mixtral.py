"""Mixtral matches transformers (logits, loss with the load-balancing aux loss, aux loss, every gradient) at
ep 1/2/4, with tp (and sequence parallel) and with context parallelism; loading reads only owned experts;
the converter round-trips the per-expert checkpoint bit for bit."""
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from parity import batch, check_sequence_sharding, close, hf_causal_lm, layer_input_lengths

MIXTRAL = dict(vocab_size=101, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
               output_router_logits=True, router_aux_loss_coef=0.05)
# layer 0 sparse with a gated shared expert and un-normalised top-k weights, layer 1 dense
QWEN2_MOE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=64,
                 output_router_logits=True, router_aux_loss_coef=0.05)
FAMILIES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE}
ATOL = 1e-5


class RecordingReader:
    """A SafetensorsReader that remembers which tensors had data read."""

    def __init__(self, inner):
        self.inner, self.read_names, self.reads = inner, set(), []

    def names(self):
        return self.inner.names()

    def __contains__(self, name):
        return name in self.inner

    def shape(self, name):
        return self.inner.shape(name)

    def dtype(self, name):
        return self.inner.dtype(name)

    def read(self, name, index=None):
        self.read_names.add(name)
        self.reads.append((name, index))
        return self.inner.read(name, index)

    def experts_read(self) -> set[int]:
        """The experts whose weights had data read: one tensor per expert (`.experts.{e}.`), or slices of a stacked
        tensor (gpt-oss's `.experts.gate_up_proj`: the expert index first)."""
        experts = set()
        for name, index in self.reads:
            if ".experts." not in name:
                continue
            tail = name.split(".experts.")[1].split(".")[0]
            if tail.isdigit():
                experts.add(int(tail))
            else:
                first = index[0] if index else slice(None)
                experts |= set(range(*first.indices(self.shape(name)[0])))
        return experts


def load_saved(hf, config, pc):
    """Our model loaded from what transformers' save_pretrained writes (per-expert tensors; saved by global rank 0
    only), and the reader that recorded which tensors were read."""
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.safetensors_io import SafetensorsReader
    from colozoo.api import build_model

    distributed = dist.is_initialized()
    first = not distributed or dist.get_rank() == 0
    directory = [tempfile.mkdtemp(prefix="colozoo-mixtral-") if first else None]
    if distributed:
        dist.broadcast_object_list(directory)
    if first:
        hf.save_pretrained(directory[0])
    if distributed:
        dist.barrier()
    reader = RecordingReader(SafetensorsReader(directory[0]))
    model = build_model(config, pc=pc, device="meta")
    load_hf_weights(model, reader, device="cpu")
    if distributed:
        dist.barrier()
    if first:
        shutil.rmtree(directory[0])
    return model, reader


def mixtral_parity(tp=1, ep=1, cp=1, sequence_parallel=False, cp_mode="ring", config_overrides=None,
                   family="mixtral"):
    from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
    from colozoo.converters import family_module
    from colozoo.layers.shard import gather_tensor, spec_of
    from colozoo.core.mesh import coords_of, init_parallel

    pc = init_parallel(tp=tp, cp=cp, ep=ep, sequence_parallel=sequence_parallel)
    config, hf = hf_causal_lm(family, {**FAMILIES.get(family, {}), **(config_overrides or {})})  # others: whole config
    ids, mask, labels = batch(config.vocab_size, 16)
    ref = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    ref.loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})

    model, reader = load_saved(hf, config, pc)
    owned = range(pc.rank("ep") * model.num_experts // ep, (pc.rank("ep") + 1) * model.num_experts // ep)
    read_experts = reader.experts_read()
    assert read_experts == set(owned), f"ep rank {pc.rank('ep')} read experts {sorted(read_experts)}"

    model.eval()
    with layer_input_lengths(model) as lengths:
        out = model(ids, attention_mask=mask, labels=labels, return_logits=True,
                    **({"cp_mode": cp_mode} if cp > 1 else {}))
    check_sequence_sharding(lengths, ids.shape[1] // cp, tp, sequence_parallel)
    out.loss.backward()
    keep = mask.bool()
    report = {"logits": (out.logits - ref.logits)[keep].abs().max().item(),
              "loss": abs(out.loss.item() - ref.loss.item()),
              "aux": abs(out.aux_loss.item() - ref.aux_loss.item())}
    where = f"(tp={tp} ep={ep} cp={cp})"
    close(out.logits[keep], ref.logits[keep], ATOL, f"logits {where}")
    close(out.loss, ref.loss, ATOL, f"loss {where}")
    close(out.aux_loss, ref.aux_loss, ATOL, f"aux loss {where}")

    sources = family_module(family).module_sources(config)
    dp = pc.size("dp")
    worst = 0.0
    for name, p in model.named_parameters():
        spec = spec_of(p)
        expected = GlobalTensor(hf_grads, sources[name], name).read()
        grad = p.grad.clone()
        # every rank trained on the same batch: expert owners summed their ep group's tokens, the rest sums over dp*cp
        if not any(s.mesh_dim == "ep" for s in spec) and pc.group("dp_cp") is not None:
            dist.all_reduce(grad, group=pc.group("dp_cp"))
        full = gather_tensor(grad / dp, spec, expected.shape, pc.groups, coords_of(pc))
        close(full, expected, ATOL, f"gradient of {name}")
        worst = max(worst, (full - expected).abs().max().item())
    report["grad"] = worst

    cp_kwargs = {"cp_mode": cp_mode} if cp > 1 else {}
    with torch.no_grad():  # the keyword overrides the config, as in transformers: no aux loss at all
        plain = model(ids, attention_mask=mask, labels=labels, output_router_logits=False, **cp_kwargs)
        ref_plain = hf(ids, attention_mask=mask, labels=labels, output_router_logits=False)
    assert plain.aux_loss is None
    close(plain.loss, ref_plain.loss, ATOL, "loss without router logits")
    return report


def test_mixtral_single_process():
    mixtral_parity()


def test_mixtral_sliding_window():
    mixtral_parity(config_overrides=dict(sliding_window=5))


@pytest.mark.parametrize("tp,ep,sp", [(1, 2, False), (1, 4, False), (2, 1, True), (2, 2, True), (2, 4, True)])
def test_mixtral_expert_and_tensor_parallel(tp, ep, sp):
    run_distributed(mixtral_parity, tp * ep, tp=tp, ep=ep, cp=1, sequence_parallel=sp,
                    timeout=300)  # 8 ranks at (2, 4) on a 2-core machine


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_mixtral_context_parallel_with_ep(mode):
    # cp=2 x tp=2; ep=2 folds over the cp ranks
    run_distributed(mixtral_parity, 4, tp=2, ep=2, cp=2, sequence_parallel=False, cp_mode=mode, timeout=150)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_converter_round_trip_bit_exact(family):
    from colozoo.checkpoint.safetensors_io import SafetensorsReader
    from colozoo.checkpoint.readers import GlobalTensor
    from colozoo.converters import family_module

    config, hf = hf_causal_lm(family, FAMILIES[family])
    hf_sources = family_module(family).hf_sources
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        reader = SafetensorsReader(directory)
        written = {}
        for name, source in hf_sources(config).items():
            tensor = GlobalTensor(reader, source, name)
            first = tensor.items[0] if source.stack else tensor
            sizes = [shape[source.cat_dim] for shape in first.part_shapes]
            written.update(source.split(tensor.read(), sizes))
        assert set(written) == set(reader.names())
        for name, value in written.items():
            original = reader.read(name)
            assert value.dtype == original.dtype and torch.equal(value, original), name
        if family == "mixtral":
            gate_up = GlobalTensor(reader, hf_sources(config)["layers.1.mlp.experts.gate_up_proj"])
            assert gate_up.shape == (4, 64, 64)
            # a slice of experts 1..2 reads exactly those experts' w1 (gate) rows
            expected = reader.read("model.layers.1.block_sparse_moe.experts.2.w1.weight")
            assert torch.equal(gate_up.read((slice(1, 3),))[1, :32], expected)


def test_qwen2_moe_single_process():
    mixtral_parity(family="qwen2_moe")


def test_qwen2_moe_tp2_ep2():
    run_distributed(mixtral_parity, 4, tp=2, ep=2, cp=1, sequence_parallel=True, cp_mode="ring", config_overrides=None,
                    family="qwen2_moe", timeout=150)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (4, True)])
def test_moe_families_tensor_parallel(family, tp, sp):
    # 4 kv heads so tp=4 shards whole heads; experts replicated over tp (ep=1), their MLP split by tp
    run_distributed(mixtral_parity, tp, tp=tp, ep=1, cp=1, sequence_parallel=sp,
                    config_overrides=dict(num_key_value_heads=4), family=family, timeout=300)


def test_qwen2_moe_context_parallel():
    run_distributed(mixtral_parity, 2, tp=1, ep=2, cp=2, sequence_parallel=False, cp_mode="all_to_all",
                    config_overrides=None, family="qwen2_moe", timeout=150)


def _per_microbatch_reference(hf, config, ids, mask, labels, dp, microbatches):
    """transformers' loss as forward_backward defines it: the token loss averaged over the whole batch, plus each
    micro-batch's router loss (over that micro-batch's rows of every data rank) weighted 1/microbatches."""
    per_rank = ids.shape[0] // dp
    per_micro = per_rank // microbatches
    total_tokens = (labels[:, 1:] != -100).sum()
    loss = 0.0
    for i in range(microbatches):
        rows = [r * per_rank + i * per_micro + j for r in range(dp) for j in range(per_micro)]
        out = hf(ids[rows], attention_mask=mask[rows], labels=labels[rows])
        router = config.router_aux_loss_coef * out.aux_loss
        loss = loss + (out.loss - router) * (labels[rows, 1:] != -100).sum() / total_tokens + router / microbatches
    return loss


def _pipeline_parity(family, pp, tp, ep, config_kwargs=None):
    """MoE layers on pipeline stages with the router losses on: every stage hands its layers' router statistics
    on with the hidden states. Eval logits, loss and aux loss, then a forward_backward over 2 micro-batches (loss
    and every gathered gradient), against transformers (on FAMILIES[family] unless `config_kwargs` is given)."""
    from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
    from colozoo.converters import family_module
    from colozoo.layers.shard import gather_tensor, spec_of
    from colozoo.core.mesh import coords_of, init_parallel
    from colozoo.runtime.training import parallelize

    pc = init_parallel(pp=pp, tp=tp, ep=ep)
    config, hf = hf_causal_lm(family, config_kwargs or FAMILIES[family])
    model = load_saved(hf, config, pc)[0].eval()
    ids, mask, labels = batch(config.vocab_size, 16, batch_size=4)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, labels=labels)
        out = model(ids, attention_mask=mask, labels=labels, return_logits=True)
        close(out.logits[mask.bool()], ref.logits[mask.bool()], ATOL, "logits")
        for what in ("loss", "aux_loss"):
            close(getattr(out, what), getattr(ref, what), ATOL, f"{what} (pp rank {pc.rank('pp')})")
        plain = model(ids, attention_mask=mask, labels=labels, output_router_logits=False)
        ref_plain = hf(ids, attention_mask=mask, labels=labels, output_router_logits=False)
        assert plain.aux_loss is None
        close(plain.loss, ref_plain.loss, ATOL, "loss without router logits")

    ref = _per_microbatch_reference(hf, config, ids, mask, labels, pc.size("dp"), 2)
    ref.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})
    parallelize(model.train(), data_parallel="ddp")
    loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
    close(loss, ref, ATOL, "forward_backward loss")
    sources = family_module(family).module_sources(config)
    for name, p in model.named_parameters():
        expected = GlobalTensor(hf_grads, sources[name], name).read()
        full = gather_tensor(p.grad, spec_of(p), expected.shape, pc.groups, coords_of(pc))
        close(full, expected, ATOL, f"gradient of {name} (pp rank {pc.rank('pp')})")
    return sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("family,pp,tp,ep", [("mixtral", 2, 2, 1), ("qwen2_moe", 2, 1, 2)])
def test_moe_pipeline_parallel(family, pp, tp, ep):
    names = run_distributed(_pipeline_parity, pp * tp * max(ep, 1), family=family, pp=pp, tp=tp, ep=ep, timeout=90)
    layers = {n.split(".")[1] for ranks in names for n in ranks if n.startswith("layers.")}
    assert layers == {"0", "1"}  # both stages' layers were checked
