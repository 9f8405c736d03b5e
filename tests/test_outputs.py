"""Outputs as transformers gives them: ModelOutput's dict / tuple / attribute access, encoders' last_hidden_state and
pooler_output, and `output_hidden_states=True` (the embedding output, then every layer's) for every family, checked
against transformers on one process, at tp=2 (sequence parallel on), cp=2 and behind FSDP; refused under pp."""
import pickle

import pytest
import torch
import transformers

from colozoo.models.outputs import ModelOutput
from distributed import run_distributed
from parity import LOGITS_ATOL, batch, causal_lm_parity, check_hidden_states, close, hf_causal_lm, hf_model
from test_bert import BASE as BERT, inputs_and_labels
from test_gpt2 import BASE as GPT2
from test_llama import BASE as LLAMA
from test_vit import vit_parity


def test_model_output_behaves_like_transformers():
    loss, logits, states = torch.tensor(2.0), torch.ones(2, 3), (torch.zeros(1), torch.ones(1))
    out = ModelOutput(logits=logits, loss=loss)
    ref = transformers.modeling_outputs.CausalLMOutput(logits=logits, loss=loss)
    assert list(out.keys()) == list(ref.keys()) == ["loss", "logits"]
    assert out[0] is loss and out[1] is logits and out["logits"] is logits and out.logits is logits
    assert out[:1] == (loss,) and out.to_tuple() == (loss, logits) and len(out) == 2
    assert "loss" in out and "hidden_states" not in out and out.hidden_states is None
    with pytest.raises(KeyError):
        out["hidden_states"]
    out.hidden_states = states                       # set later: a key, in field order
    out.aux_loss = torch.tensor(0.5)
    assert list(out.keys()) == ["loss", "aux_loss", "logits", "hidden_states"]
    assert out[3] is states and out["aux_loss"] is out.aux_loss
    out.aux_loss = None                              # set to None: no longer a key
    assert list(out.keys()) == ["loss", "logits", "hidden_states"]
    out["loss"] = torch.tensor(3.0)                  # an item is the attribute too
    assert out.loss.item() == 3.0 and isinstance(out, dict)
    for forbidden in (lambda: out.pop("loss"), lambda: out.update(loss=1), lambda: out.__delitem__("loss")):
        with pytest.raises(TypeError):
            forbidden()
    copy = pickle.loads(pickle.dumps(out))
    assert list(copy.keys()) == list(out.keys()) and torch.equal(copy.logits, logits)
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    assert len(leaves) == 4 and list(torch.utils._pytree.tree_unflatten(leaves, spec).keys()) == list(out.keys())


def _load(architecture, config_kwargs, task=None):
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel

    model_type = getattr(transformers, architecture).config_class.model_type
    config = transformers.AutoConfig.for_model(model_type, architectures=[architecture], **config_kwargs)
    hf = hf_model(architecture, config)
    model = build_model(config, parallel=init_parallel(), device="meta", task=task)
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    return hf, model.eval()


def test_code_written_for_transformers_runs_unchanged():
    """Indexing, keys, to_tuple, `in`, return_dict=False and the config's output_hidden_states, as transformers."""
    inputs, _ = inputs_and_labels("BertModel")
    hf, model = _load("BertModel", BERT)
    for kwargs in ({}, {"output_hidden_states": True}):
        ref, out = hf(**inputs, **kwargs), model(**inputs, **kwargs)
        assert list(out.keys()) == list(ref.keys()) and "loss" not in out
        assert len(out.to_tuple()) == len(ref.to_tuple())
        close(out[0], ref[0], LOGITS_ATOL, "out[0]")
        close(out["last_hidden_state"], ref["last_hidden_state"], LOGITS_ATOL, "out['last_hidden_state']")
        close(out[1], ref[1], LOGITS_ATOL, "out[1] (pooler_output)")
    plain = model(**inputs, return_dict=False)
    assert isinstance(plain, tuple) and len(plain) == 2
    close(plain[0], hf(**inputs, return_dict=False)[0], LOGITS_ATOL, "return_dict=False")
    model.config.output_hidden_states = True  # as in transformers, the config's default applies
    assert len(model(**inputs).hidden_states) == BERT["num_hidden_layers"] + 1

    inputs, labels = inputs_and_labels("BertForSequenceClassification")
    hf, model = _load("BertForSequenceClassification", {**BERT, "num_labels": 3})
    ref, out = hf(**inputs, labels=labels), model(**inputs, labels=labels)
    assert list(out.keys()) == list(ref.keys()) == ["loss", "logits"] and "loss" in out
    loss, logits = out.to_tuple()
    close(loss, ref[0], LOGITS_ATOL, "out[0] (loss)")
    close(logits, ref["logits"], LOGITS_ATOL, "logits")
    assert "loss" not in model(**inputs) and model(**inputs)[0].shape == ref.logits.shape

    hf, model = _load("LlamaForCausalLM", LLAMA)
    ids, mask, labels = batch(LLAMA["vocab_size"], 8)
    ref = hf(ids, attention_mask=mask, labels=labels, output_hidden_states=True, use_cache=False)
    out = model(ids, attention_mask=mask, labels=labels, return_logits=True, output_hidden_states=True)
    assert list(out.keys()) == list(ref.keys()) == ["loss", "logits", "hidden_states"]
    keep = mask.bool()
    close(out[0], ref[0], LOGITS_ATOL, "out[0] (loss)")
    close(out[1][keep], ref[1][keep], LOGITS_ATOL, "out[1] (logits)")
    check_hidden_states(out[2], ref[2], keep)


@pytest.mark.parametrize("architecture", ["BertModel", "BertForMaskedLM", "BertForSequenceClassification"])
def test_bert_hidden_states(architecture):
    from parity import task_parity

    inputs, labels = inputs_and_labels(architecture)
    report = task_parity(architecture, {**BERT, "num_labels": 3}, inputs, labels)
    assert "hidden_states" in report


@pytest.mark.parametrize("architecture", ["ViTModel", "ViTForImageClassification"])
def test_vit_hidden_states(architecture):
    assert "hidden_states" in vit_parity(architecture)


@pytest.mark.parametrize("sp", [False, True])
def test_encoders_hidden_states_tp2(sp):
    from test_bert import bert_parity

    for report in run_distributed(bert_parity, 2, architecture="BertModel", tp=2, sp=sp):
        assert "hidden_states" in report  # compared entry by entry by the harness (parity.check_hidden_states)
    # ViT under sequence parallelism pads CLS + 16 patches to 18 tokens: the padding never shows
    for report in run_distributed(vit_parity, 2, architecture="ViTModel", tp=2, sp=sp):
        assert "hidden_states" in report  # compared entry by entry by the harness (parity.check_hidden_states)


@pytest.mark.parametrize("family,config", [("llama", LLAMA), ("gpt2", GPT2)])
def test_causal_lm_hidden_states_tp2(family, config):
    """The last entry is the final norm's output, as transformers' decoders give it (the rest: each layer's input)."""
    for report in run_distributed(causal_lm_parity, 2, model_type=family, config_kwargs=config, tp=2,
                                  sequence_parallel=True):
        assert "hidden_states" in report  # compared entry by entry by the harness (parity.check_hidden_states)


def _hidden_states_on_mesh(family, config_kwargs, cp=1, dp=1, fsdp=False):
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel
    from colozoo.runtime.training import parallelize

    parallel = init_parallel(cp=cp, dp=dp)
    config, hf = hf_causal_lm(family, config_kwargs)
    ids, mask, labels = batch(config.vocab_size, 16)
    ref = hf(ids, attention_mask=mask, output_hidden_states=True)
    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    model.eval()
    if fsdp:
        parallelize(model, data_parallel="fsdp")  # model(...) now runs through the (wrapped) stage
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
    return check_hidden_states(out.hidden_states, ref.hidden_states, mask.bool())


def test_hidden_states_context_parallel_and_fsdp():
    run_distributed(_hidden_states_on_mesh, 2, family="llama", config_kwargs=LLAMA, cp=2)
    run_distributed(_hidden_states_on_mesh, 2, family="gpt2", config_kwargs=GPT2, dp=2, fsdp=True)


def _refused_under_pp():
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(pp=2)
    config = transformers.AutoConfig.for_model("llama", **LLAMA)
    model = build_model(config, parallel=parallel, device="cpu")
    ids, mask, _ = batch(config.vocab_size, 8)
    with pytest.raises(ValueError, match="output_hidden_states=True is not supported with pipeline parallelism"):
        model(ids, attention_mask=mask, output_hidden_states=True)
    return model(ids, attention_mask=mask).hidden_states  # without it the pipeline runs as before


def test_hidden_states_refused_under_pipeline_parallelism():
    assert run_distributed(_refused_under_pp, 2) == [None, None]
