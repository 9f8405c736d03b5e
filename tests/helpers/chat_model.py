"""A tiny LLaMA saved by transformers, with a word-level tokenizer whose chat template is a small Jinja template."""
import json
from pathlib import Path

from eval_model import EXTRAS

from colozoo.demo_finetune import make_tiny_causal_lm, texts

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "data" / "chat.jsonl"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def conversations(path=CHAT) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def make_chat_llama(path, layers=2, positions=128, template=TEMPLATE) -> Path:
    from transformers import AutoTokenizer

    words = [m["content"] for r in conversations() for m in r["messages"]]
    corpus = texts() + words + ["<|system|> <|user|> <|assistant|>", "answer question"]
    make_tiny_causal_lm(path, "llama", corpus=corpus, layers=layers, positions=positions, **EXTRAS["llama"](64))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(path))
    return Path(path)
