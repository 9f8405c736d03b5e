"""Every family of the table against transformers, from the tiny config it declares (colozoo.models.family.Tiny):
logits, loss (with the load-balancing loss where the config asks for it), hidden states and every gathered gradient
on one process and on each mesh the family declares (tensor parallel with sequence parallelism, pipeline stages,
expert and context parallelism); the partitioner's weight of a layer against the model built.
Generation, packing, round trips, LoRA and checkpoints take the same cases (tests/helpers/family_cases.py)."""
import pytest

from distributed import run_distributed
from family_cases import (CAUSAL, ENCODERS, NAMES, TABLE, mesh_cases, mesh_degrees, tiny_config, tiny_kwargs,
                          world_size)
from family_parity import family_parity, family_pipeline_parity

TIMEOUT = 300


def encoder_parity(family: str, tp: int = 1, pp: int = 1, sequence_parallel: bool = False):
    """An encoder's head (the architecture its tiny config names) against transformers: outputs, hidden states, loss
    and every gradient; over pp stages, the eval forward and a forward_backward through the schedule."""
    from family_cases import encoder_inputs
    from parity import task_parity, task_pipeline_parity

    config = tiny_config(family)
    kwargs = {k: v for k, v in tiny_kwargs(family).items() if k != "architectures"}
    inputs, labels = encoder_inputs(config)
    if pp > 1:
        return task_pipeline_parity(config.architectures[0], kwargs, inputs, labels, pp=pp, tp=tp,
                                    sequence_parallel=sequence_parallel)
    return task_parity(config.architectures[0], kwargs, inputs, labels, tp=tp, sequence_parallel=sequence_parallel)


def parity(family: str, pp: int = 1, **mesh):
    if family in ENCODERS:
        return encoder_parity(family, pp=pp, **mesh)
    if pp > 1:
        return family_pipeline_parity(family, pp=pp, **mesh)
    return family_parity(family, **mesh)


@pytest.mark.parametrize("family", NAMES)
def test_matches_transformers_on_one_process(family):
    parity(family)


@pytest.mark.parametrize("family,mesh", mesh_cases())
def test_matches_transformers_on_mesh(family, mesh):
    run_distributed(parity, world_size(mesh), family=family, **mesh_degrees(mesh), timeout=TIMEOUT)


# --- what the partitioner weighs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", CAUSAL)
def test_partitioning_weighs_a_layer_as_the_model_holds_it(family):
    """layer_cost reads a layer's size off the config through the family's hooks (attention_size, mlp_width,
    experts, expert_width, shared_expert_width, sparse_layers): its mean layer, recovered from the head's share
    (vocab x hidden weights), is the mean layer of the model built, but for norms and biases (within 5% here)."""
    from colozoo.api import build_model
    from colozoo.models.partition import layer_cost

    config = tiny_config(family)
    model = build_model(config, device="meta")
    built = sum(p.numel() for p in model.layers.parameters()) / len(model.layers)
    _, _, head_share = layer_cost(config, "params")
    assert config.vocab_size * config.hidden_size / head_share == pytest.approx(built, rel=0.05)


def test_every_family_declares_a_mesh():
    assert all(TABLE[name].tiny is not None and TABLE[name].tiny.meshes for name in NAMES)
