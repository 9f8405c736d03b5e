"""A transformers user's script runs unchanged on a colozoo model: load, logits, loss, backward, an optimizer over
model.parameters(), generate, train again, gradient checkpointing, save, reload in transformers; the same script on
transformers' own model gives the same numbers at every line. At tp=2 the script runs whole; at pp=2 the lines whose
meaning carries over (a pipeline trains through forward_backward). Bad calls get one clear line."""
import pytest
import torch
import transformers

import colozoo
from distributed import run_distributed
from parity import close

CONFIGS = {
    "gpt2": dict(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0),
    "llama": dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64),
    "qwen3": dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64),
}
TIMEOUT = 240


def make_checkpoint(path, family):
    config = transformers.AutoConfig.for_model(family, **CONFIGS[family], eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # spread weights: continuations that depend on the context
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(path)
    transformers.GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0).save_pretrained(path)
    return path


def user_script(model, path, save_to):
    """What a transformers user writes, line by line; every result it prints is returned."""
    seen = {}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (2, 10), generator=g)
    seen["logits"] = model(ids).logits
    out = model(ids, labels=ids)
    seen["loss"] = out.loss
    out.loss.backward()
    seen["grad"] = model.get_input_embeddings().weight.grad.clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer.step()
    optimizer.zero_grad()
    seen["generated"] = model.generate(ids[:, :6])  # the model's generation_config: 5 new tokens, greedy
    model.train()
    model.gradient_checkpointing_enable()
    seen["loss_after_step"] = model(ids, labels=ids).loss
    seen["loss_after_step"].backward()
    optimizer.step()
    model.eval()
    seen["logits_after_training"] = model(ids).logits
    seen["parameters"] = model.num_parameters()
    seen["surface"] = (model.device.type, model.dtype, model.can_generate(), model.get_output_embeddings() is not None)
    model.save_pretrained(save_to)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(save_to)
    seen["reloaded_logits"] = reloaded(ids).logits
    seen["reloaded_generation"] = reloaded.generate(ids[:, :6])
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in seen.items()}


def compare(ours: dict, theirs: dict, what: str):
    for key, expected in theirs.items():
        if key not in ours:
            continue
        got = ours[key]
        if isinstance(expected, torch.Tensor) and expected.is_floating_point():
            close(got, expected, 1e-4, f"{what}: {key}")
        elif isinstance(expected, torch.Tensor):
            assert torch.equal(got, expected), f"{what}: {key}\nours {got}\nhf   {expected}"
        else:
            assert got == expected, f"{what}: {key}: {got} != {expected}"


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_transformers_script_runs_unchanged_and_gives_transformers_numbers(family, tmp_path):
    path = make_checkpoint(tmp_path / "hf", family)
    theirs = user_script(transformers.AutoModelForCausalLM.from_pretrained(path), path, tmp_path / "theirs")
    ours = user_script(colozoo.from_pretrained(str(path)), path, tmp_path / "ours")
    compare(ours, theirs, family)


def _on_a_mesh(family, path, save_to, tp=1, pp=1):
    model = colozoo.from_pretrained(str(path), tp=tp, pp=pp)
    if pp == 1:
        return user_script(model, path, save_to)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (2, 10), generator=g)
    with pytest.raises(RuntimeError, match="forward_backward"):
        model(ids, labels=ids)
    with torch.no_grad():
        seen = {"logits": model(ids).logits, "loss": model(ids, labels=ids).loss}
    seen["generated"] = model.generate(ids[:, :6])
    model.save_pretrained(save_to)
    seen["reloaded_logits"] = transformers.AutoModelForCausalLM.from_pretrained(save_to)(ids).logits.detach()
    return seen


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_the_same_script_on_a_mesh(tmp_path, tp, pp):
    path = make_checkpoint(tmp_path / "hf", "llama")
    theirs = user_script(transformers.AutoModelForCausalLM.from_pretrained(path), path, tmp_path / "theirs")
    results = run_distributed(_on_a_mesh, tp * pp, family="llama", path=path, save_to=tmp_path / "ours", tp=tp, pp=pp,
                              timeout=TIMEOUT)
    for rank, ours in enumerate(results):
        if tp > 1:  # every rank counts its own shards; the embedding gradient is this rank's vocab slice
            ours.pop("parameters"), ours.pop("grad")
        if pp > 1:  # the logits after the first optimizer step do not carry over: compare the untrained ones
            theirs = {k: v for k, v in theirs.items() if k in ("logits", "loss")}
            theirs["reloaded_logits"] = theirs["logits"]
        compare(ours, theirs, f"tp={tp} pp={pp} rank {rank}")


def test_saving_as_transformers_does(tmp_path):
    """format="hf" by default, the tokenizer and generation config it was loaded with along, an existing directory
    replaced as transformers replaces it (its other files stay), atomically."""
    from eval_model import EXTRAS

    from colozoo.demo_finetune import make_tiny_causal_lm

    path = make_tiny_causal_lm(tmp_path / "hf", "llama", layers=2, **EXTRAS["llama"](64))
    transformers.GenerationConfig(eos_token_id=[2, 5], max_new_tokens=7).save_pretrained(path)
    model = colozoo.from_pretrained(str(path))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00009.safetensors").write_text("a stale shard of an older save")
    model.save_pretrained(out)
    names = sorted(p.name for p in out.iterdir())
    assert "notes.txt" in names and "model-00001-of-00009.safetensors" not in names
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(names)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [2, 5]
    assert transformers.AutoTokenizer.from_pretrained(out).get_vocab() == \
        transformers.AutoTokenizer.from_pretrained(path).get_vocab()
    model.save_pretrained(out)  # again, over itself
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[3, 4, 5, 6]])
    close(reloaded(ids).logits, model(ids).logits, 1e-5, "reloaded logits")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp or old directory left


@pytest.mark.parametrize("call,match", [
    (lambda m: m(torch.tensor([1, 2, 3])), r"input_ids must be \(batch, length\).*input_ids\[None\]"),
    (lambda m: m(torch.zeros(1, 0, dtype=torch.long)), "hold no tokens"),
    (lambda m: m(torch.tensor([[1, 500]])), r"outside the vocabulary \[0, 96\)"),
    (lambda m: m(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2]])), "labels .* must have input_ids' shape"),
    (lambda m: m(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 3)), "attention_mask"),
    (lambda m: m.generate(torch.tensor([1, 2, 3])), r"\(batch, length\)"),
    (lambda m: m.generate(torch.zeros(1, 0, dtype=torch.long)), "no prompt"),
    (lambda m: m.generate(torch.tensor([[1, 500]])), "outside the vocabulary"),
    (lambda m: m(torch.tensor([[1, 2]]), inputs_embeds=torch.zeros(1, 2, 32)), "input_ids or inputs_embeds"),
])
def test_bad_calls_get_one_clear_line(tmp_path, call, match):
    model = colozoo.from_pretrained(str(make_checkpoint(tmp_path / "hf", "llama")))
    with pytest.raises(ValueError, match=match):
        call(model)


def test_inputs_embeds_and_torch_dtype(tmp_path):
    path = make_checkpoint(tmp_path / "hf", "gpt2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = colozoo.from_pretrained(str(path), torch_dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 3]])
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=embeds, labels=ids)
    ref_embeds = embeds.detach().clone().requires_grad_()
    ref = hf(inputs_embeds=ref_embeds, labels=ids)
    close(out.logits, ref.logits, 1e-5, "logits from inputs_embeds")
    out.loss.backward()
    ref.loss.backward()
    close(embeds.grad, ref_embeds.grad, 1e-5, "the gradient of inputs_embeds")
    assert model(ids, use_cache=False).logits.shape == (1, 4, 96)
