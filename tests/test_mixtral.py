"""Mixtral and Qwen2-MoE on the meshes beyond the family table's (tests/test_family_table.py: one process, tp2 with
sequence parallelism, ep 2, pp2 x tp2): logits, loss with the load-balancing loss, aux loss and every gradient at
ep 4, tp2 x ep2/4, tp 2/4 over 4 kv heads and with context parallelism; a sliding window; loading reads only owned
experts; the converter's map splits the per-expert checkpoint bit for bit and reads a slice of experts only."""
import tempfile

import pytest
import torch

from distributed import run_distributed
from family_parity import RecordingReader, family_parity, family_pipeline_parity, load_saved  # noqa: F401 (others)
from parity import hf_causal_lm

from colozoo.models import family_of

FAMILIES = {name: family_of(name).tiny.config for name in ("mixtral", "qwen2_moe")}


def test_mixtral_sliding_window():
    family_parity("mixtral", overrides=dict(sliding_window=5))


@pytest.mark.parametrize("tp,ep,sp", [(1, 4, False), (2, 2, True), (2, 4, True)])
def test_mixtral_expert_and_tensor_parallel(tp, ep, sp):
    run_distributed(family_parity, tp * ep, family="mixtral", tp=tp, ep=ep, sequence_parallel=sp,
                    timeout=300)  # 8 ranks at (2, 4) on a 2-core machine


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_mixtral_context_parallel_with_ep(mode):
    # cp=2 x tp=2; ep=2 folds over the cp ranks
    run_distributed(family_parity, 4, family="mixtral", tp=2, ep=2, cp=2, cp_mode=mode, timeout=150)


def test_converter_reads_one_expert_per_file_and_slices_of_experts():
    from colozoo.checkpoint.readers import GlobalTensor
    from colozoo.checkpoint.safetensors_io import SafetensorsReader
    from colozoo.converters import family_module

    config, hf = hf_causal_lm("mixtral", FAMILIES["mixtral"])
    hf_sources = family_module("mixtral").hf_sources
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
        gate_up = GlobalTensor(reader, hf_sources(config)["layers.1.mlp.experts.gate_up_proj"])
        assert gate_up.shape == (4, 64, 64)
        # a slice of experts 1..2 reads exactly those experts' w1 (gate) rows
        expected = reader.read("model.layers.1.block_sparse_moe.experts.2.w1.weight")
        assert torch.equal(gate_up.read((slice(1, 3),))[1, :32], expected)


def test_qwen2_moe_tp2_ep2():
    run_distributed(family_parity, 4, family="qwen2_moe", tp=2, ep=2, sequence_parallel=True, timeout=150)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (4, True)])
def test_moe_families_tensor_parallel(family, tp, sp):
    # 4 kv heads so tp=4 shards whole heads; experts replicated over tp (ep=1), their MLP split by tp
    run_distributed(family_parity, tp, family=family, tp=tp, sequence_parallel=sp,
                    overrides=dict(num_key_value_heads=4), timeout=300)


def test_qwen2_moe_context_parallel():
    run_distributed(family_parity, 2, family="qwen2_moe", ep=2, cp=2, cp_mode="all_to_all", timeout=150)


@pytest.mark.parametrize("family,pp,tp,ep", [("qwen2_moe", 2, 1, 2)])
def test_moe_pipeline_parallel(family, pp, tp, ep):
    names = run_distributed(family_pipeline_parity, pp * tp * max(ep, 1), family=family, pp=pp, tp=tp, ep=ep,
                            timeout=90)
    layers = {n.split(".")[1] for ranks in names for n in ranks if n.startswith("layers.")}
    assert layers == {"0", "1"}  # both stages' layers were checked


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_every_moe_family_reads_capacity_factor_and_its_sparse_layers(family):
    """A capacity_factor set on the config caps every MoE family's experts (the option MoEDecoderModel documents),
    and each family's MoE layers are those its sparse_layers counts."""
    import transformers

    from colozoo.layers.moe import MoE
    from colozoo.models import build_shard

    tiny = family_of(family)
    config = transformers.AutoConfig.for_model(tiny.model_types[0], **tiny.tiny.config)
    config.capacity_factor = 1.5
    model = build_shard(config, device="meta")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == tiny.model.sparse_layers(config) > 0
    assert all(m.capacity_factor == 1.5 for m in moes)
