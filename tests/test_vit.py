import pytest
import torch
import transformers

from distributed import run_distributed
from parity import close, hf_round_trip, task_parity

# 8x8 images in 2x2 patches: 16 patches + CLS = 17 tokens, a multiple of neither 2 nor 4 (sequence-parallel padding)
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=8,
            patch_size=2, num_channels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ARCHITECTURES = ["ViTModel", "ViTForImageClassification"]


def images_and_labels(architecture, config, num_labels=3, batch_size=2):
    size = config["image_size"] if isinstance(config["image_size"], tuple) else (config["image_size"],) * 2
    pixels = torch.randn(batch_size, 3, *size, generator=torch.Generator().manual_seed(1))
    labels = None
    if architecture == "ViTForImageClassification":
        labels = (torch.linspace(0.5, -1.0, batch_size) if num_labels == 1
                  else torch.arange(batch_size) * (num_labels - 1) % num_labels)
    return dict(pixel_values=pixels), labels


def vit_parity(architecture, tp=1, sp=False, config=None, num_labels=3):
    config = {**BASE, "num_labels": num_labels, **(config or {})}
    inputs, labels = images_and_labels(architecture, config, num_labels)
    return task_parity(architecture, config, inputs, labels, tp=tp, sequence_parallel=sp)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_vit_single_process(architecture):
    vit_parity(architecture)


def test_vit_options():
    vit_parity("ViTModel", config=dict(qkv_bias=False, hidden_act="gelu_new", pooler_act="relu",
                                       image_size=(8, 6), patch_size=(2, 3)))


def test_vit_regression_head():
    vit_parity("ViTForImageClassification", num_labels=1)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_vit_tensor_parallel(architecture, tp, sp):
    run_distributed(vit_parity, tp, architecture=architecture, tp=tp, sp=sp)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_vit_converter_round_trip(architecture):
    hf_round_trip("vit", BASE, architecture=architecture)


def test_vit_converter_round_trip_tp2():
    run_distributed(hf_round_trip, 2, model_type="vit", config_kwargs=BASE, tp=2,
                    architecture="ViTForImageClassification")


def test_wrong_image_size_is_a_clear_error():
    from colozoo.api import build_model

    model = build_model(transformers.ViTConfig(**BASE), device="cpu")
    with pytest.raises(ValueError, match="image size"):
        model(torch.zeros(1, 3, 16, 16))


def test_published_names_and_in_memory_names_both_load():
    """transformers saves ViT (and the hub checkpoints hold it) under encoder.layer.N.attention.attention.query...,
    while its in-memory state dict says layers.N.attention.q_proj; the converter maps the saved names and reads both."""
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.converters.vit import hf_sources
    from colozoo.api import build_model
    from parity import hf_model

    config = transformers.ViTConfig(**BASE, num_labels=3, architectures=["ViTForImageClassification"])
    names = {n for s in hf_sources(config).values() for n in s.names}
    for name in ("vit.encoder.layer.1.attention.attention.query.weight", "vit.encoder.layer.1.attention.output.dense.bias",
                 "vit.encoder.layer.1.intermediate.dense.weight", "vit.encoder.layer.1.output.dense.weight",
                 "vit.encoder.layer.1.layernorm_before.weight", "vit.embeddings.patch_embeddings.projection.weight"):
        assert name in names, name
    hf = hf_model("ViTForImageClassification", config)
    model = build_model(config, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    pixels = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        close(model.eval()(pixels).logits, hf(pixels).logits, 1e-5, "logits")


def vit_pipeline_parity(architecture, pp, tp, sp):
    from parity import task_pipeline_parity

    config = {**BASE, "num_hidden_layers": 4, "num_labels": 3}
    inputs, labels = images_and_labels(architecture, config, batch_size=4)
    return task_pipeline_parity(architecture, config, inputs, labels, pp=pp, tp=tp, sequence_parallel=sp)


@pytest.mark.parametrize("pp,tp,sp", [(2, 1, False), (2, 2, True), (2, 4, False)])
def test_vit_image_classification_pipeline_parallel(pp, tp, sp):
    # with sequence parallelism the 17 tokens are padded to 18 and split over tp between the stages
    run_distributed(vit_pipeline_parity, pp * tp, architecture="ViTForImageClassification", pp=pp, tp=tp, sp=sp)


def checkpointed_step(mode):
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.api import build_model
    from colozoo.core.rng import model_parallel_seed
    from colozoo.runtime.training import parallelize
    from parity import check_recomputation, hf_model, weight_calls

    config = transformers.ViTConfig(**{**BASE, "hidden_dropout_prob": 0.2, "attention_probs_dropout_prob": 0.2},
                                    num_labels=3, architectures=["ViTForImageClassification"])
    model = build_model(config, device="meta")
    load_hf_weights(model, StateDictReader(hf_model("ViTForImageClassification", config).state_dict()), device="cpu")
    parallelize(model.train(), activation_checkpointing=mode)
    inputs, labels = images_and_labels("ViTForImageClassification", BASE, batch_size=4)
    model_parallel_seed(5, model.parallel)  # the default and the tracked generator: earlier tests may have seeded it
    with weight_calls(model) as calls:
        loss = model.forward_backward(inputs["pixel_values"], labels, num_microbatches=2)
    check_recomputation(calls, model, mode, microbatches=2)
    return model, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_selective_checkpointing_recomputes_vit_attention():
    from colozoo.runtime.checkpointing import is_checkpointed

    _, loss, grads = checkpointed_step(None)
    model, loss_ckpt, grads_ckpt = checkpointed_step("selective")
    assert all(is_checkpointed(layer.self_attn) for layer in model.layers.values())
    assert loss_ckpt == loss
    for name, g in grads.items():
        torch.testing.assert_close(grads_ckpt[name], g, rtol=0, atol=1e-6, msg=name)
