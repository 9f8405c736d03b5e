import pytest
import torch
import transformers

from distributed import run_distributed
from parity import hf_round_trip, task_parity

# 8x8 images in 2x2 patches: 16 patches + CLS = 17 tokens, a multiple of neither 2 nor 4 (sequence-parallel padding)
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=8,
            patch_size=2, num_channels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ARCHITECTURES = ["ViTModel", "ViTForImageClassification"]


def vit_parity(architecture, tp=1, sp=False, config=None, num_labels=3):
    config = {**BASE, "num_labels": num_labels, **(config or {})}
    size = config["image_size"] if isinstance(config["image_size"], tuple) else (config["image_size"],) * 2
    pixels = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    labels = None
    if architecture == "ViTForImageClassification":
        labels = torch.tensor([0.5, -1.0]) if num_labels == 1 else torch.tensor([0, num_labels - 1])
    return task_parity(architecture, config, dict(pixel_values=pixels), labels, tp=tp, sequence_parallel=sp)


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
    run_distributed(vit_parity, tp, architecture, tp, sp)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_vit_converter_round_trip(architecture):
    hf_round_trip("vit", BASE, architecture=architecture)


def test_vit_converter_round_trip_tp2():
    run_distributed(hf_round_trip, 2, "vit", BASE, 2, "ViTForImageClassification")


def test_wrong_image_size_is_a_clear_error():
    from colozoo.models import build_model

    model = build_model(transformers.ViTConfig(**BASE), device="cpu")
    with pytest.raises(ValueError, match="image size"):
        model(torch.zeros(1, 3, 16, 16))
