"""Supervised fine-tuning data: chat records masked to the assistant turns, prompt/completion records, packing with
position_ids restarting per sample, and Parquet / Arrow / datasets directories read lazily with one-line errors."""
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from chat_model import CHAT, conversations, make_chat_llama  # noqa: E402
from parity import close  # noqa: E402

from colozoo.finetune import data as D  # noqa: E402
from colozoo.finetune import records, sft  # noqa: E402
from colozoo.finetune.records import DataError  # noqa: E402

pa = pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_llama(tmp_path_factory.mktemp("chat-llama"))


@pytest.fixture(scope="module")
def tok(chat_model):
    return D.load_tokenizer(chat_model, 10_000)


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def trained_spans(labels: torch.Tensor) -> list[list[int]]:
    """The runs of consecutive trained labels of one row."""
    spans, current = [], []
    for value in labels.tolist() + [-100]:
        if value != -100:
            current.append(value)
        elif current:
            spans.append(current)
            current = []
    return spans


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_loss_only_on_assistant_turns(tok, tmp_path):
    data = sft.sft_dataset(CHAT, tok, seq_len=96, pack_samples=False)
    convs = conversations()
    eos = tok.eos_token_id
    for row, conv in enumerate(convs):
        answers = [ids_of(tok, m["content"]) + [eos] for m in conv["messages"] if m["role"] == "assistant"]
        assert trained_spans(data.tensors["labels"][row]) == answers  # exactly the answers and their end token
        ids = data.tensors["input_ids"][row][data.tensors["attention_mask"][row].bool()].tolist()
        assert ids == ids_of(tok, tok.apply_chat_template(conv["messages"], tokenize=False))
    assert data.tokens.tolist() == [sum(len(ids_of(tok, m["content"])) + 1 for m in c["messages"]
                                        if m["role"] == "assistant") for c in convs]


def test_prompt_completion_and_text_records(tok, tmp_path):
    path = write_jsonl(tmp_path / "prompt_completion.jsonl", [{"prompt": "What did the fox eat?",
                                                      "completion": "The fox ate berries."},
                                               {"text": "The bear slept near the river."}])
    data = sft.sft_dataset(path, tok, seq_len=32, pack_samples=False)
    prompt, answer = tok("What did the fox eat?")["input_ids"], ids_of(tok, "The fox ate berries.") + [tok.eos_token_id]
    labels = data.tensors["labels"]
    assert data.tensors["input_ids"][0, : len(prompt) + len(answer)].tolist() == prompt + answer
    assert trained_spans(labels[0]) == [answer]
    text = ids_of(tok, "The bear slept near the river.") + [tok.eos_token_id]
    assert trained_spans(labels[1]) == [text[1:]]  # the first token has nothing before it to predict it from


def test_packing_restarts_positions_and_masks_boundaries(tok):
    seq_len = 128
    samples = [sft.tokenize_sample(c, tok) for c in conversations()]
    packed = sft.sft_dataset(CHAT, tok, seq_len=seq_len)
    ids, pos, labels = (packed.tensors[k] for k in ("input_ids", "position_ids", "labels"))
    assert "attention_mask" not in packed.tensors and len(packed) < len(samples)  # several samples per row
    found = []
    for r in range(len(packed)):
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [seq_len]
        for a, b in zip(starts, starts[1:]):
            assert pos[r, a:b].tolist() == list(range(b - a))
            assert labels[r, a] == -100  # nothing is predicted across a boundary (labels shift by one in the loss)
            found.append((ids[r, a:b].tolist(), labels[r, a:b].tolist()))
    real = [(i, lab) for i, lab in found if i != [tok.pad_token_id] * len(i)]  # padded tails: documents of their own
    assert [i for i, _ in real] == [s for s, _ in samples]  # every sample whole, in order, none split across rows
    for (sample_ids, trained), (_, lab) in zip(samples, real):
        assert lab == [-100] + [t if flag else -100 for t, flag in zip(sample_ids[1:], trained[1:])]
    assert all(set(lab) == {-100} for i, lab in found if (i, lab) not in real)
    short = sft.sft_dataset(CHAT, tok, seq_len=40, truncate="tokens")  # longer samples are cut: their end is dropped
    first = samples[0][0]
    assert short.tensors["input_ids"][0].tolist() == first[:40] and len(first) > 40


def answer_labels(rows: torch.Tensor, answers: list[list[int]]) -> torch.Tensor:
    """Labels that keep, scanning the rows in order, each next answer's tokens where they occur; -100 elsewhere."""
    labels, pending = torch.full_like(rows, -100), list(answers)
    for r, row in enumerate(rows.tolist()):
        at = 0
        while pending:
            want = pending[0]
            hit = next((i for i in range(at, len(row) - len(want) + 1) if row[i: i + len(want)] == want), None)
            if hit is None:
                break
            labels[r, hit: hit + len(want)] = torch.tensor(want)
            at = hit + len(want)
            pending.pop(0)
    return labels


def test_masked_loss_equals_hand_computed_cross_entropy(chat_model, tok):
    import colozoo

    model = colozoo.from_pretrained(str(chat_model))
    answers = [ids_of(tok, m["content"]) + [tok.eos_token_id]
               for c in conversations() for m in c["messages"] if m["role"] == "assistant"]
    for packed in (True, False):
        data = sft.sft_dataset(CHAT, tok, seq_len=128 if packed else 96, pack_samples=packed)
        batch = data.take(range(3))
        labels = batch.pop("labels")
        out = model(**batch, labels=labels, return_logits=True)
        logits = out.logits.float()
        vocab = logits.shape[-1]
        hand = answer_labels(batch["input_ids"], answers)  # found from the answers' own tokens, not from sft
        masked = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), hand[:, 1:].reshape(-1), ignore_index=-100)
        close(out.loss, masked, 1e-5, f"prompt-masked loss ({'packed' if packed else 'padded'})")
        everything = batch["input_ids"][:, 1:].reshape(-1)
        unmasked = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), everything)
        assert abs(unmasked.item() - out.loss.item()) > 1e-3  # the prompt tokens really are left out


def test_chat_samples_are_prompted_with_the_conversation_up_to_the_answer(tok):
    from colozoo.finetune.samples import held_out_prompts

    data = sft.sft_dataset(CHAT, tok, seq_len=128, pack_samples=False)
    ids, mask = held_out_prompts(data, 2, 64, until_answer=True)
    for row, keep, conv in zip(ids, mask, conversations()):
        messages = conv["messages"]
        upto = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = ids_of(tok, tok.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=True))
        assert row[keep.bool()].tolist() == prompt


BAD_RECORDS = {
    "role": ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "yes"}]},
             r"bad\.jsonl:2: message 0 has role 'robot'; roles are system, user, assistant, tool"),
    "no_assistant": ({"messages": [{"role": "user", "content": "hi"}]},
                     r"bad\.jsonl:2: the conversation has no assistant turn"),
    "content": ({"messages": [{"role": "user", "content": 3}]}, r"bad\.jsonl:2: message 0 has content 3, not a string"),
    "completion": ({"prompt": "hi"}, r"bad\.jsonl:2: field 'completion' is None, not a string"),
    "fields": ({"question": "hi"}, r"bad\.jsonl:2: no field 'messages', 'prompt'/'completion' or 'text'"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_bad_chat_records_are_one_line_naming_file_and_line(case, tok, tmp_path):
    record, message = BAD_RECORDS[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [conversations()[0], record])
    with pytest.raises(DataError, match=message):
        sft.sft_dataset(path, tok, 64)


def test_chat_needs_a_template_that_renders_prefixes(chat_model, tok, tmp_path):
    from transformers import AutoTokenizer

    from colozoo.finetune.grpo_data import tokenize_prompt
    from colozoo.finetune.preference_data import tokenize_pair

    plain = AutoTokenizer.from_pretrained(str(chat_model))
    plain.chat_template = None
    no_template = r"{}: a conversation needs a tokenizer with a chat template, and this one has none \(set "
    with pytest.raises(DataError, match=no_template.format(r"chat\.jsonl:1") + "tokenizer.chat_template, or use prompt"):
        sft.sft_dataset(CHAT, plain, 64)
    conversation = [{"role": "user", "content": "hi"}]  # DPO's and GRPO's readers say it alike
    with pytest.raises(DataError, match=no_template.format("pair") + r"tokenizer\.chat_template, or use string records"):
        tokenize_pair({"prompt": conversation, "chosen": conversation, "rejected": conversation}, plain, "pair")
    with pytest.raises(DataError, match=no_template.format("prompt") + r"tokenizer\.chat_template, or use string prompts"):
        tokenize_prompt(conversation, plain, "prompt")
    counting = AutoTokenizer.from_pretrained(str(chat_model))  # numbers each turn by the conversation's length
    counting.chat_template = "{% for m in messages %}{{ messages|length }} {{ m['content'] }} {% endfor %}"
    with pytest.raises(DataError, match=r"chat\.jsonl:1: the chat template does not render the conversation up to "
                                        r"assistant turn \d as a prefix"):
        sft.sft_dataset(CHAT, counting, 64)
    with pytest.raises(DataError, match=r"or pass --chat for them"):
        list(D.read_records(CHAT, ("text",)))


# ------------------------------------------------------------------------------------------- Parquet / Arrow


def _table(rows):
    return pa.Table.from_pylist(rows)


def test_parquet_arrow_and_datasets_directories_read_like_jsonl(tok, tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    rows = conversations()
    table = _table(rows)
    pq.write_table(table, tmp_path / "chat.parquet", row_group_size=5)
    with pa.OSFile(str(tmp_path / "chat.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=5)
    import datasets

    hf = datasets.Dataset.from_list(rows)
    hf.save_to_disk(str(tmp_path / "saved"), max_shard_size=1500)  # Arrow streams named in state.json
    datasets.DatasetDict({"train": hf, "test": hf.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert len(records.dataset_files(tmp_path / "saved")) > 1
    reference = sft.sft_dataset(CHAT, tok, 128)
    for path in (tmp_path / "chat.parquet", tmp_path / "chat.arrow", tmp_path / "saved", tmp_path / "dict"):
        got = sft.sft_dataset(path, tok, 128)
        assert all(torch.equal(got.tensors[k], reference.tensors[k]) for k in reference.tensors), path
    text_rows = [{"text": t} for t in ("the fox ran", "the bear slept", "Anna smiled")]
    pq.write_table(_table(text_rows), tmp_path / "text.parquet")
    write_jsonl(tmp_path / "text.jsonl", text_rows)
    assert torch.equal(D.lm_dataset(tmp_path / "text.parquet", tok, 4).tensors["input_ids"],
                       D.lm_dataset(tmp_path / "text.jsonl", tok, 4).tensors["input_ids"])


def test_arrow_is_read_one_record_batch_at_a_time(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    pq.write_table(_table([{"text": f"row {i}"} for i in range(10)]), tmp_path / "t.parquet", row_group_size=3)
    monkeypatch.setattr(records, "BATCH_ROWS", 3)
    batches = []
    original = records._batches

    def counting(file):
        for batch in original(file):
            batches.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(records, "_batches", counting)
    stream = D.read_records(tmp_path / "t.parquet", ("text",))
    assert next(stream) == {"text": "row 0"} and batches == [3]  # the first record before the rest is read
    assert [r["text"] for r in stream][-1] == "row 9" and batches == [3, 3, 3, 1]


def test_bad_arrow_rows_name_file_and_row(tok, tmp_path):
    import pyarrow.parquet as pq

    pq.write_table(_table([{"text": "the fox"}, {"text": None}]), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: row 1: field 'text' is None, not a string"):
        D.lm_dataset(tmp_path / "t.parquet", tok, 4)
    pq.write_table(_table([{"messages": [{"role": "user", "content": "hi"}]}]), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"c\.parquet: row 0: the conversation has no assistant turn"):
        sft.sft_dataset(tmp_path / "c.parquet", tok, 64)
    (tmp_path / "broken.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(DataError, match=r"broken\.arrow: not a readable arrow file"):
        D.lm_dataset(tmp_path / "broken.arrow", tok, 4)
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["validation"]}))
    with pytest.raises(DataError, match=r"dd is a DatasetDict without a 'train' split \(splits: \['validation'\]\)"):
        D.lm_dataset(tmp_path / "dd", tok, 4)


def test_parquet_records_stream_in_bounded_memory(tmp_path):
    import pyarrow.parquet as pq

    rows, width = 20_000, 2_000  # 40 MB of text; Arrow never holds more than a few record batches of it
    text = pa.array([f"{i:08d}" + "x" * (width - 8) for i in range(rows)])
    pq.write_table(pa.table({"text": text}), tmp_path / "big.parquet", row_group_size=1_000, compression="none")
    del text
    baseline, peak, count = pa.total_allocated_bytes(), 0, 0
    for record in D.read_records(tmp_path / "big.parquet", ("text",)):
        count += 1
        peak = max(peak, pa.total_allocated_bytes() - baseline)
    assert count == rows and record["text"].startswith(f"{rows - 1:08d}")
    assert peak < rows * width / 8, f"{peak / 1e6:.1f} MB held while reading"
