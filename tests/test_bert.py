import pytest
import torch
import transformers

from distributed import run_distributed
from parity import hf_round_trip, task_parity

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ARCHITECTURES = ["BertModel", "BertForMaskedLM", "BertForSequenceClassification"]


def inputs_and_labels(architecture: str, num_labels: int = 3, seq_len: int = 12):
    """Two sequences with two segments (token types), the second right-padded; labels for the task."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, BASE["vocab_size"], (2, seq_len), generator=g)
    mask = torch.ones(2, seq_len, dtype=torch.long)
    mask[1, seq_len - 3:] = 0
    token_types = torch.zeros(2, seq_len, dtype=torch.long)
    token_types[:, seq_len // 2:] = 1
    inputs = dict(input_ids=ids, attention_mask=mask, token_type_ids=token_types)
    if architecture == "BertForMaskedLM":
        labels = ids.masked_fill((torch.rand(2, seq_len, generator=g) < 0.5) | (mask == 0), -100)
    elif architecture == "BertForSequenceClassification":
        labels = torch.tensor([0.5, -1.0]) if num_labels == 1 else torch.tensor([0, num_labels - 1])
    else:
        labels = None
    return inputs, labels


def bert_parity(architecture, tp=1, sp=False, config=None, num_labels=3):
    config = {**BASE, "num_labels": num_labels, **(config or {})}
    inputs, labels = inputs_and_labels(architecture, num_labels)
    return task_parity(architecture, config, inputs, labels, tp=tp, sequence_parallel=sp)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bert_single_process(architecture):
    bert_parity(architecture)


def test_bert_regression_head():
    bert_parity("BertForSequenceClassification", num_labels=1)


def test_bert_untied_mlm_decoder_relu():
    bert_parity("BertForMaskedLM", config=dict(tie_word_embeddings=False, hidden_act="relu"))


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bert_tensor_parallel(architecture, tp, sp):
    # vocab 101 is divisible by neither 2 nor 4: the padded vocabulary of the tied MLM decoder is exercised
    run_distributed(bert_parity, tp, architecture, tp, sp)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bert_converter_round_trip(architecture):
    hf_round_trip("bert", BASE, architecture=architecture)


def test_bert_converter_round_trip_tp2():
    run_distributed(hf_round_trip, 2, "bert", BASE, 2, "BertForMaskedLM")


def test_task_follows_architectures_and_can_be_chosen():
    from colozoo.models import build_model

    config = transformers.BertConfig(**BASE, architectures=["BertForPreTraining"])
    assert type(build_model(config, device="meta")).__name__ == "BertForMaskedLM"
    model = build_model(config, device="meta", task="sequence_classification")
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.architectures == ["BertForSequenceClassification"]
    assert config.architectures == ["BertForPreTraining"]  # the caller's config is left alone
    with pytest.raises(ValueError, match="unknown task 'causal_lm'"):
        build_model(config, device="meta", task="causal_lm")


def test_unsupported_options_are_clear_errors():
    from colozoo.models import build_model

    with pytest.raises(ValueError, match="decoder"):
        build_model(transformers.BertConfig(**BASE, is_decoder=True), device="meta")


def test_bert_masked_lm_pipeline_parallel():
    # pp=2 x tp=2 with sequence parallelism; the tied decoder's word-embedding copy lives on the last stage
    from parity import pipeline_parity

    inputs, labels = inputs_and_labels("BertForMaskedLM")
    config = {**BASE, "num_hidden_layers": 4}
    run_distributed(pipeline_parity, 4, "BertForMaskedLM", config, inputs["input_ids"], inputs["attention_mask"],
                    labels, 2, 2, True)
