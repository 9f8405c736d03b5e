import pytest
import torch
import transformers

from distributed import run_distributed
from parity import hf_round_trip, task_parity

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ARCHITECTURES = ["BertModel", "BertForMaskedLM", "BertForSequenceClassification"]


def inputs_and_labels(architecture: str, num_labels: int = 3, seq_len: int = 12, batch_size: int = 2):
    """Sequences with two segments (token types), the last right-padded; labels for the task."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, BASE["vocab_size"], (batch_size, seq_len), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    mask[-1, seq_len - 3:] = 0
    token_types = torch.zeros(batch_size, seq_len, dtype=torch.long)
    token_types[:, seq_len // 2:] = 1
    token_types[0, seq_len // 3:] = 1  # segments of different lengths
    inputs = dict(input_ids=ids, attention_mask=mask, token_type_ids=token_types)
    if architecture == "BertForMaskedLM":
        labels = ids.masked_fill((torch.rand(batch_size, seq_len, generator=g) < 0.5) | (mask == 0), -100)
    elif architecture == "BertForSequenceClassification":
        labels = (torch.linspace(1.0, -1.0, batch_size) if num_labels == 1
                  else torch.arange(batch_size) % num_labels)
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
    run_distributed(bert_parity, tp, architecture=architecture, tp=tp, sp=sp)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bert_converter_round_trip(architecture):
    hf_round_trip("bert", BASE, architecture=architecture)


def test_bert_converter_round_trip_tp2():
    run_distributed(hf_round_trip, 2, model_type="bert", config_kwargs=BASE, tp=2, architecture="BertForMaskedLM")


def test_task_follows_architectures_and_can_be_chosen():
    from colozoo.api import build_model

    config = transformers.BertConfig(**BASE, architectures=["BertForPreTraining"])
    assert type(build_model(config, device="meta")).__name__ == "BertForMaskedLM"
    model = build_model(config, device="meta", task="sequence_classification")
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.architectures == ["BertForSequenceClassification"]
    assert config.architectures == ["BertForPreTraining"]  # the caller's config is left alone
    with pytest.raises(ValueError, match="unknown task 'causal_lm'"):
        build_model(config, device="meta", task="causal_lm")


def test_unsupported_options_are_clear_errors():
    from colozoo.api import build_model

    with pytest.raises(ValueError, match="decoder"):
        build_model(transformers.BertConfig(**BASE, is_decoder=True), device="meta")


@pytest.mark.parametrize("tp,sp", [(2, True), (4, False)])
def test_bert_masked_lm_pipeline_parallel(tp, sp):
    # pp=2 x tp; the tied decoder's word-embedding copy lives on the last stage
    from parity import pipeline_parity

    inputs, labels = inputs_and_labels("BertForMaskedLM")
    config = {**BASE, "num_hidden_layers": 4}
    run_distributed(pipeline_parity, 2 * tp, architecture="BertForMaskedLM", config_kwargs=config,
                    ids=inputs["input_ids"], mask=inputs["attention_mask"], labels=labels, pp=2, tp=tp,
                    sequence_parallel=sp)


def bert_pipeline_parity(architecture, pp, tp, sp, batch_size=4):
    from parity import task_pipeline_parity

    inputs, labels = inputs_and_labels(architecture, batch_size=batch_size)
    config = {**BASE, "num_hidden_layers": 4, "num_labels": 3}
    return task_pipeline_parity(architecture, config, inputs, labels, pp=pp, tp=tp, sequence_parallel=sp)


def test_bert_sequence_classification_pipeline_parallel():
    # pp=2 x tp=2 with sequence parallelism: token_type_ids and padding go through the stages and micro-batches,
    # the classification logits come back on every rank
    run_distributed(bert_pipeline_parity, 4, architecture="BertForSequenceClassification", pp=2, tp=2, sp=True)


def test_bert_base_model_pipeline_parallel():
    # hidden states and pooled output from the last stage on every rank; its tie_word_embeddings ties nothing
    run_distributed(bert_pipeline_parity, 2, architecture="BertModel", pp=2, tp=1, sp=False)


def selective_checkpointing_gradients(mode):
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.api import build_model
    from colozoo.core.rng import model_parallel_seed
    from colozoo.runtime.training import parallelize

    config = transformers.BertConfig(**{**BASE, "hidden_dropout_prob": 0.2, "attention_probs_dropout_prob": 0.2},
                                     num_labels=3, architectures=["BertForSequenceClassification"])
    from parity import check_recomputation, hf_model, weight_calls

    model = build_model(config, device="meta")
    load_hf_weights(model, StateDictReader(hf_model("BertForSequenceClassification", config).state_dict()),
                    device="cpu")
    parallelize(model.train(), activation_checkpointing=mode)
    inputs, labels = inputs_and_labels("BertForSequenceClassification", batch_size=4)
    model_parallel_seed(5, model.parallel)  # the default and the tracked generator: earlier tests may have seeded it
    with weight_calls(model) as calls:
        loss = model.forward_backward(inputs["input_ids"], labels, attention_mask=inputs["attention_mask"],
                                      token_type_ids=inputs["token_type_ids"], num_microbatches=2)
    check_recomputation(calls, model, mode, microbatches=2)
    return model, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_selective_checkpointing_recomputes_bert_attention():
    from colozoo.runtime.checkpointing import is_checkpointed

    _, loss, grads = selective_checkpointing_gradients(None)
    model, loss_ckpt, grads_ckpt = selective_checkpointing_gradients("selective")
    for layer in model.layers.values():  # the whole attention block is recomputed, and nothing else
        assert [m for m in layer.modules() if is_checkpointed(m)] == [layer.self_attn]
    assert loss_ckpt == loss
    for name, g in grads.items():  # dropout masks included: recomputation replays the same random numbers
        torch.testing.assert_close(grads_ckpt[name], g, rtol=0, atol=1e-6, msg=name)
