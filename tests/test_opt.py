import pytest
import torch

from distributed import run_distributed
from family_cases import tiny_kwargs
from parity import causal_lm_parity, close

# the declared config: tests/test_family_table.py runs it on one process, at tp2 with sequence parallelism and pp2 x tp2
BASE = tiny_kwargs("opt")
OPTIONS = {
    # opt-350m: post-LN blocks, no final LayerNorm, embeddings projected 32 <-> 64
    "350m_post_ln_projected": dict(do_layer_norm_before=False, word_embed_proj_dim=32),
    "no_bias": dict(enable_bias=False),
    "no_affine": dict(layer_norm_elementwise_affine=False),
    "untied": dict(tie_word_embeddings=False),
    "removed_final_ln": dict(_remove_final_layer_norm=True),
    "gelu": dict(activation_function="gelu"),
    "pad_in_last_vocab_slice": dict(pad_token_id=99),
    "no_pad_token": dict(pad_token_id=None),
    "projected_untied_no_bias": dict(word_embed_proj_dim=48, tie_word_embeddings=False, enable_bias=False),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_opt_single_process(option):
    causal_lm_parity("opt", {**BASE, **OPTIONS[option]}, tp=1)


def test_opt_single_process_unpadded():
    causal_lm_parity("opt", BASE, tp=1, padded=False)


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (4, True)])
def test_opt_tensor_parallel(tp, sp):
    # vocab 101 is divisible by neither 2 nor 4: the padding path is always exercised
    run_distributed(causal_lm_parity, tp, model_type="opt", config_kwargs=BASE, tp=tp, sequence_parallel=sp,
                    timeout=120)


@pytest.mark.parametrize("tp,option", [(2, "350m_post_ln_projected"), (4, "350m_post_ln_projected"),
                                       (2, "projected_untied_no_bias"), (2, "no_affine"),
                                       (4, "pad_in_last_vocab_slice")])
def test_opt_options_sequence_parallel(tp, option):
    run_distributed(causal_lm_parity, tp, model_type="opt", config_kwargs={**BASE, **OPTIONS[option]}, tp=tp,
                    sequence_parallel=True, timeout=120)


def test_opt_unpadded_batch_tp2():
    run_distributed(causal_lm_parity, 2, model_type="opt", config_kwargs=BASE, tp=2, sequence_parallel=False,
                    padded=False, timeout=120)


def _parity_with_plain_qkv_split(config_kwargs, tp):
    """Split the fused q/k/v rows as one block (rank 0 gets all of q and half of k): parity must fail."""
    import colozoo.models.opt as opt
    from colozoo.layers import Split

    original = opt.opt_attention

    def wrong_split(*args, **kwargs):
        attention = original(*args, **kwargs)
        for p in attention.qkv.parameters():
            p.shard_spec = (Split("tp", 0),)
        return attention

    opt.opt_attention = wrong_split
    try:
        causal_lm_parity("opt", config_kwargs, tp)
    except AssertionError as e:
        return str(e)
    finally:
        opt.opt_attention = original
    return None


def test_opt_wrong_head_split_fails_parity():
    errors = run_distributed(_parity_with_plain_qkv_split, 2, config_kwargs=BASE, tp=2, timeout=120)
    assert all(e is not None and "logits differ" in e for e in errors), errors


def _build(config_kwargs, tp, training=False):
    import transformers

    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(tp=tp)
    model = build_model(transformers.OPTConfig(**config_kwargs), parallel=parallel, device="meta")
    if training:
        model.train()
        model.batch_context(torch.zeros(1, 4, dtype=torch.long))
    return model


def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_opt_refuses_heads_not_divisible_by_tp():
    errors = run_distributed(_error_of, 2, _build, {**BASE, "num_attention_heads": 1}, 2, timeout=60)
    assert all(e and e.startswith("UnsupportedConfig") and "num_attention_heads" in e for e in errors), errors


def test_opt_refuses_layerdrop_in_training():
    error = _error_of(_build, {**BASE, "layerdrop": 0.1}, 1, True)
    assert error and error.startswith("UnsupportedConfig") and "layerdrop" in error, error
    assert _error_of(_build, {**BASE, "layerdrop": 0.1}, 1, False) is None  # eval ignores layerdrop, as in HF


def test_opt_module_names_match_the_converter_map():
    import transformers

    from colozoo.converters import family_module

    for option in OPTIONS.values():
        config = transformers.OPTConfig(**{**BASE, **option})
        names = {n for n, _ in _build({**BASE, **option}, 1).named_parameters()}
        assert names == set(family_module("opt").hf_sources(config)), option


@pytest.mark.parametrize("option", ["350m_post_ln_projected", "untied"])
def test_opt_loads_a_save_pretrained_checkpoint(tmp_path, option):
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.safetensors_io import SafetensorsReader
    from colozoo.api import build_model
    from parity import batch, hf_causal_lm

    config, hf = hf_causal_lm("opt", {**BASE, **OPTIONS[option]})
    hf.save_pretrained(tmp_path)
    model = build_model(config, device="meta")
    load_hf_weights(model, SafetensorsReader(tmp_path), device="cpu")
    ids, mask, _ = batch(config.vocab_size, 12)
    with torch.no_grad():
        ours = model.eval()(ids, attention_mask=mask, return_logits=True).logits
        theirs = hf(ids, attention_mask=mask).logits
    close(ours[mask.bool()], theirs[mask.bool()], 1e-5, "logits")


def _train_step_with_dropout(tp):
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel
    from colozoo.core.rng import model_parallel_seed
    from parity import batch, check_sequence_sharding, hf_causal_lm, layer_input_lengths

    parallel = init_parallel(tp=tp, sequence_parallel=True)
    config, hf = hf_causal_lm("opt", {**BASE, "dropout": 0.2, "attention_dropout": 0.2})
    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    model_parallel_seed(0, parallel)
    ids, mask, labels = batch(config.vocab_size, 12)
    with torch.no_grad():
        eval_loss = model.eval()(ids, attention_mask=mask, labels=labels).loss.item()
    with layer_input_lengths(model) as lengths:
        train_loss = model.train()(ids, attention_mask=mask, labels=labels).loss
    check_sequence_sharding(lengths, ids.shape[1], tp, sequence_parallel=True)
    train_loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    return eval_loss, train_loss.item()


def test_opt_dropout_in_training_tp2():
    (eval0, train0), (eval1, train1) = run_distributed(_train_step_with_dropout, 2, tp=2, timeout=120)
    assert eval0 == eval1 and train0 == train1  # the loss is the same on every tp rank
    assert abs(train0 - eval0) > 1e-4  # dropout did something


def _pipeline_parity(config_kwargs, pp, tp):
    """Eval forward through pp stages (the last holds its own copy of the tied embedding) equals transformers."""
    from parity import LOGITS_ATOL, batch, hf_causal_lm

    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(pp=pp, tp=tp)
    config, hf = hf_causal_lm("opt", config_kwargs)
    model = load_hf_weights(build_model(config, parallel=parallel, device="meta"), StateDictReader(hf.state_dict()),
                            device="cpu").eval()
    ids, mask, labels = batch(config.vocab_size, 12)
    with torch.no_grad():  # a pipeline evaluates without gradients
        out = model(ids, attention_mask=mask, labels=labels, return_logits=True)
    ref = hf(ids, attention_mask=mask, labels=labels)
    close(out.logits[mask.bool()], ref.logits[mask.bool()], LOGITS_ATOL, "logits")
    close(out.loss, ref.loss, LOGITS_ATOL, "loss")


@pytest.mark.parametrize("option", ["350m_post_ln_projected"])
def test_opt_pipeline_pp2_tp2(option):
    run_distributed(_pipeline_parity, 4, config_kwargs={**BASE, **OPTIONS[option]}, pp=2, tp=2, timeout=150)
