"""`colozoo generate` as people use a chat model: greedy at temperature 0, the chat template applied with a system
message and only the replies printed, stop strings, a PEFT adapter, its own ranks (--nproc-per-node), and every
prompt's text streamed in order."""
import io
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from chat_model import make_chat_llama  # noqa: E402

from colozoo.cli import main  # noqa: E402
from colozoo.demo_finetune import make_tiny_gpt2  # noqa: E402
from colozoo.generate_stream import OrderedStreamer  # noqa: E402


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return make_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), n_layer=2, n_positions=64)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return make_chat_llama(tmp_path_factory.mktemp("chat"))


def generated(capsys, *argv) -> str:
    assert main(["generate", *map(str, argv)]) == 0
    return capsys.readouterr().out


def replies(path, messages: list[list[dict]], max_new_tokens: int, adapter=None) -> list[str]:
    """What the model answers each conversation, greedy, up to its end token: the reference for the CLI."""
    import transformers

    import colozoo

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), padding_side="left")
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    model = colozoo.from_pretrained(str(path), adapter=adapter)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    found = []
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        end = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row)
        found.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return found


def test_temperature_zero_is_greedy(gpt2, capsys):
    greedy = generated(capsys, gpt2, "--prompt", "once upon a time", "--max-new-tokens", "12")
    for seed in (1, 2):
        assert generated(capsys, gpt2, "--prompt", "once upon a time", "--max-new-tokens", "12", "--temperature", "0",
                         "--seed", seed) == greedy
    sampled = {generated(capsys, gpt2, "--prompt", "once upon a time", "--max-new-tokens", "12", "--temperature",
                         "1.5", "--seed", seed) for seed in (1, 2)}
    assert len(sampled) == 2  # a positive temperature does sample


def test_chat_prints_each_reply_alone_with_the_template_and_system_message_applied(chat, capsys):
    questions = ["What did the fox eat on Wednesday?", "Where did the bear go?"]
    out = generated(capsys, chat, "--chat", "--system", "You tell short stories.", "--prompt", questions[0],
                    "--prompt", questions[1], "--max-new-tokens", "10")
    system = [{"role": "system", "content": "You tell short stories."}]
    expected = replies(chat, [system + [{"role": "user", "content": q}] for q in questions], 10)
    assert out == expected[0] + "\n\n" + expected[1] + "\n"
    assert "<|" not in out and "stories" not in out  # neither the template nor the system message is echoed


def test_plain_prompts_print_the_prompt_then_its_continuation_unless_reply_only(gpt2, capsys):
    both = generated(capsys, gpt2, "--prompt", "the cat", "--prompt", "once upon a time", "--max-new-tokens", "6")
    only = generated(capsys, gpt2, "--prompt", "the cat", "--prompt", "once upon a time", "--max-new-tokens", "6",
                     "--reply-only")
    for prompt, with_prompt, reply in zip(["the cat", "once upon a time"], both.split("\n\n"), only.split("\n\n")):
        assert with_prompt.startswith(prompt) and with_prompt[len(prompt):].strip() == reply.strip() != ""


def test_stop_ends_a_reply_before_the_stop_text(chat, capsys):
    question = ["--chat", "--prompt", "What did the fox eat on Wednesday?", "--max-new-tokens", "10"]
    full = generated(capsys, chat, *question).rstrip("\n")
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    out = generated(capsys, chat, *question, "--stop", stop)
    assert out == full[:full.index(stop)] + "\n"


def test_adapter_is_attached(chat, tmp_path, capsys):
    import colozoo
    from colozoo.runtime.lora import apply_lora

    model = colozoo.from_pretrained(str(chat))
    apply_lora(model, r=4, alpha=8, targets="all-linear")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora" in name:
                p.normal_(0, 0.3)  # B starts at zero: move it, so the adapter changes the answers
    model.save_pretrained(tmp_path / "adapter", format="peft")
    question = "What did the fox eat on Wednesday?"
    out = generated(capsys, chat, "--chat", "--prompt", question, "--max-new-tokens", "8", "--adapter",
                    tmp_path / "adapter")
    user = [[{"role": "user", "content": question}]]
    assert out == replies(chat, user, 8, adapter=str(tmp_path / "adapter"))[0] + "\n"
    assert out != replies(chat, user, 8)[0] + "\n"


def test_nproc_per_node_starts_the_ranks_itself(gpt2, capfd):
    prompts = ["--prompt", "the cat", "--prompt", "once upon a time", "--max-new-tokens", "6"]
    assert main(["generate", str(gpt2), *prompts]) == 0
    single = capfd.readouterr().out
    assert main(["generate", str(gpt2), "--nproc-per-node", "2", "--tp", "2", *prompts]) == 0
    out, err = capfd.readouterr()
    assert out == single  # rank 0 prints, the same greedy text
    assert err.startswith("prefill ") and err.count("\n") == 1  # rank 0's speed line, and no noise from any rank


class Tokens:
    """A tokenizer whose token i spells chr(ord('a') + i) (0 is the end token, which decodes to nothing)."""
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids if i or not skip_special_tokens)


def test_many_prompts_stream_in_order_each_as_soon_as_the_one_before_ends():
    out = io.StringIO()
    streamer = OrderedStreamer(Tokens(), [[1], [2]], stop_strings=["xy"], eos_token_ids=[0], out=out)
    streamer.put(torch.tensor([[1], [2]]))
    seen = []
    for step in ([3, 4], [0, 5], [7, 7], [7, 23], [7, 24]):  # row 0 ends at its 2nd token; row 1 writes "hxy"
        streamer.put(torch.tensor(step))
        seen.append(out.getvalue())
    streamer.end()
    # row 1 catches up as row 0 ends; its "x" waits (it may start the stop string "xy"), which then ends it
    assert seen == ["d", "d\n\nef", "d\n\nefh", "d\n\nefh", "d\n\nefh\n"]
    assert out.getvalue() == "d\n\nefh\n" and streamer.texts() == ["d", "efh"]


def test_the_console_script_exits_quietly_after_triton_was_imported():
    """Triton's nanobind bindings report every object still alive at exit as leaked (~30 lines per process, the last
    one glued to the next output); the console script's fast exit must not leave them alive for it."""
    import subprocess

    code = "import triton, colozoo.cli as cli; cli.main = lambda: (print('done'), 0)[-1]; cli.main_and_exit()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "done\n", "")
