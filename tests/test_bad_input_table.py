"""Bad input to every command, as a table: each row is refused with exit code 1 and one line on stderr saying what is
wrong, before any rank starts where ranks are launched, and leaves nothing behind (the case's directory holds after
exactly what it held before). Rows marked `# issue 29` were wrong before: a traceback, a silent exit 0, a check
after launching or tokenizing, another wording, or a directory left behind."""
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from chat_model import CHAT, make_chat_llama  # noqa: E402

from colozoo import cli  # noqa: E402
from colozoo.demo_finetune import make_tiny_gpt2  # noqa: E402

STORIES = Path(__file__).resolve().parent.parent / "data" / "stories.jsonl"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A GPT-2 (4 heads, 2 layers, 32 positions, no chat template), a chat LLaMA, a LoRA run of the LLaMA (its
    output directory) and a copy of the LLaMA with other weights."""
    from colozoo.finetune.config import FinetuneConfig
    from colozoo.finetune.loop import finetune

    root = tmp_path_factory.mktemp("models")
    gpt2 = make_tiny_gpt2(root / "gpt2", n_layer=2, n_positions=32)
    chat = make_chat_llama(root / "chat")
    finetune(FinetuneConfig(model=str(chat), data=str(CHAT), output=str(root / "lora-run"), chat=True, seq_len=64,
                            steps=1, lora_r=4, eval_interval=0, samples=0, progress=False, plot=False,
                            export_hf=False))
    from safetensors.torch import load_file, save_file

    shutil.copytree(chat, root / "other")
    weights = load_file(root / "other" / "model.safetensors")
    save_file({k: v * 1.01 for k, v in weights.items()}, root / "other" / "model.safetensors",
              metadata={"format": "pt"})
    bare = root / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(gpt2 / name, bare / name)
    return {"gpt2": gpt2, "chat": chat, "run": root / "lora-run", "other": root / "other", "bare": bare}


def write(path: Path, content) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def jsonl(path: Path, records) -> Path:
    return write(path, "".join(json.dumps(r) + "\n" for r in records))


def finetune(m, w, *extra, model="gpt2", data=None, output=None, steps=("--steps", "1")):
    """`model`: a key of the models fixture, or a name or path as it is."""
    return ["finetune", "--model", str(m.get(model, model)), "--data", str(data or STORIES), "--output",
            str(output or w / "out"), "--seq-len", "16", *steps, "--no-progress", "--no-plot", *extra]


def generate(m, w, *extra, model="gpt2"):
    return ["generate", str(m.get(model, model)), *extra]


def lora_checkpoint(m):
    return str(next((m["run"] / "checkpoints").iterdir()))


def resumable(m, w):
    shutil.copytree(m["run"], w / "out")
    return ["finetune", "--model", str(m["other"]), "--data", str(CHAT), "--output", str(w / "out"), "--chat",
            "--seq-len", "64", "--steps", "1", "--lora-r", "4", "--eval-interval", "0", "--samples", "0",
            "--no-progress", "--no-plot", "--no-export-hf"]


def eval_task(w, data) -> Path:
    """A folder with an lm-eval task `mine` whose data file is `data`."""
    (w / "tasks").mkdir()
    return write(w / "tasks" / "mine.yaml", f"task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                           f"    test: {data}\noutput_type: loglikelihood_rolling\ntest_split: test\n"
                                           f"doc_to_text: ''\ndoc_to_target: '{{{{text}}}}'\n").parent


def tiny_bert(w) -> Path:
    import transformers

    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    transformers.BertForMaskedLM(config).save_pretrained(str(w / "bert"))
    return w / "bert"


PAIR = {"prompt": "the cat", "chosen": " sat on the mat", "rejected": " ran"}
LONG_PROMPT = {**PAIR, "prompt": "the cat sat on the mat"}

ONE_CONVERSATION = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
REWARDS = "def boom(completions, **kwargs):\n    raise ZeroDivisionError('no reward')\n\n\n" \
          "def short(completions, **kwargs):\n    return [1.0]\n"


def grpo(m, w, *extra, rewards="boom", data=None):
    """--method grpo on two prompts, 2 completions of 4 tokens each, with a reward function of REWARDS."""
    spec = f"{write(w / 'rewards.py', REWARDS)}:{rewards}" if rewards in ("boom", "short") else rewards
    prompts = data or jsonl(w / "p.jsonl", [{"prompt": "the cat"}, {"prompt": "a dog"}])
    return ["finetune", "--model", str(m["gpt2"]), "--data", str(prompts), "--output", str(w / "out"), "--method",
            "grpo", "--reward-funcs", spec, "--num-generations", "2", "--max-completion-length", "4",
            "--micro-batch-size", "4", "--steps", "1", "--eval-fraction", "0", "--no-progress", "--no-plot", *extra]

# name -> (argv of (models, work dir), what stderr says); a setup writes its files into the work dir first
CASES = {
    # finetune: data
    "data missing": (lambda m, w: finetune(m, w, data=w / "nope.jsonl"), r"dataset .*nope\.jsonl does not exist"),
    "data empty": (lambda m, w: finetune(m, w, data=write(w / "d.jsonl", "\n")), r"d\.jsonl is empty"),
    "data not JSON": (lambda m, w: finetune(m, w, data=write(w / "d.jsonl", "{oops\n")), r"d\.jsonl:1: not valid JSON"),
    "data binary": (lambda m, w: finetune(m, w, data=write(w / "d.jsonl", b'{"text": "a"}\n\x89PNG\x00\xff\n')),
                    r"d\.jsonl:2: binary data"),
    "data Latin-1": (lambda m, w: finetune(m, w, data=write(w / "d.jsonl", '{"text": "a"}\n{"text": "café"}\n'.encode(
        "latin-1"))), r"d\.jsonl:2: not UTF-8 \(byte 0xE9 at line 2, column 14\)"),
    "data field missing": (lambda m, w: finetune(m, w, data=jsonl(w / "d.jsonl", [{"body": "x"}])),
                           r"d\.jsonl:1: no field 'text'"),
    "data text a number": (lambda m, w: finetune(m, w, data=jsonl(w / "d.jsonl", [{"text": 3}])),
                           r"field 'text' is 3, not a string"),
    "data a list": (lambda m, w: finetune(m, w, data=jsonl(w / "d.jsonl", [["text"]])), r"a JSON list, not an object"),
    "data a bad directory": (lambda m, w: finetune(m, w, data=(w / "dir").mkdir() or w / "dir"),
                             r"directory without a datasets state\.json"),
    "eval data missing": (lambda m, w: finetune(m, w, "--eval-data", str(w / "nope.jsonl")),
                          r"nope\.jsonl does not exist"),
    "fewer samples than a global batch": (  # issue 29: failed after tokenizing, leaving OUTPUT/data-cache
        lambda m, w: finetune(m, w, "--micro-batch-size", "64", data=jsonl(w / "d.jsonl", [{"text": "the cat"}] * 40)),
        r"fewer than one global batch of 64"),
    "chat messages not a list": (lambda m, w: finetune(m, w, "--chat", model="chat", data=jsonl(
        w / "d.jsonl", [{"messages": "hi"}])), r"'messages' must be a non-empty list"),
    "chat without an answer": (lambda m, w: finetune(m, w, "--chat", model="chat", data=jsonl(
        w / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])), r"no assistant turn"),
    "chat role unknown": (lambda m, w: finetune(m, w, "--chat", model="chat", data=jsonl(
        w / "d.jsonl", [{"messages": [{"role": "bot", "content": "hi"}]}])), r"has role 'bot'"),
    "chat completion missing": (lambda m, w: finetune(m, w, "--chat", model="chat", data=jsonl(
        w / "d.jsonl", [{"prompt": "hi"}])), r"field 'completion' is None, not a string"),
    "chat without a template": (lambda m, w: finetune(m, w, "--chat", data=jsonl(w / "d.jsonl", [ONE_CONVERSATION])),
                                r"needs a tokenizer with a chat template"),
    "preference record without rejected": (lambda m, w: finetune(m, w, "--method", "dpo", data=jsonl(
        w / "d.jsonl", [{"prompt": "the cat", "chosen": " sat"}])), r"d\.jsonl:1: no field 'rejected'"),
    "preference completion empty": (lambda m, w: finetune(m, w, "--method", "dpo", data=jsonl(
        w / "d.jsonl", [PAIR, {**PAIR, "rejected": ""}])), r"d\.jsonl:2: the rejected completion is empty"),
    "preference prompt past --max-length": (lambda m, w: finetune(m, w, "--method", "dpo", "--max-length", "4",
                                                                  data=jsonl(w / "d.jsonl", [LONG_PROMPT])),
        r"d\.jsonl:1: the prompt is 6 tokens, not shorter than --max-length 4"),
    "preference roles not alternating": (lambda m, w: finetune(m, w, "--method", "dpo", model="chat", data=jsonl(
        w / "d.jsonl", [{"prompt": [{"role": "user", "content": "hi"}, {"role": "user", "content": "hi"}],
                         "chosen": [{"role": "assistant", "content": "hello"}],
                         "rejected": [{"role": "assistant", "content": "no"}]}])),
        r"d\.jsonl:1: 'chosen': the roles do not alternate: messages 0 and 1 are both 'user' turns"),
    "preference beta 0": (lambda m, w: finetune(m, w, "--method", "dpo", "--beta", "0"), r"--beta must be > 0, got 0"),
    "preference option without dpo": (lambda m, w: finetune(m, w, "--beta", "0.2"), r"--beta goes with --method dpo"),
    "grpo reward function raises": (lambda m, w: grpo(m, w),
                                    r"reward function .*rewards\.py:boom raised ZeroDivisionError: no reward at step 1"),
    "grpo reward function returns too few": (lambda m, w: grpo(m, w, rewards="short"),
                                             r"reward function .*:short returned 1 rewards for 4 completions at step 1"),
    "grpo reward function does not import": (lambda m, w: grpo(m, w, rewards="no_such_module:score"),
        r"--reward-funcs no_such_module:score: cannot import no_such_module: ModuleNotFoundError"),
    "grpo num-generations 1": (lambda m, w: grpo(m, w, "--num-generations", "1"),
                               r"--num-generations must be >= 2: each completion's advantage"),
    "grpo global batch not divisible": (lambda m, w: grpo(m, w, "--num-generations", "3"),
        r"global batch 4 \(completions per step\) is not divisible by --num-generations 3"),
    "grpo record without prompt": (lambda m, w: grpo(m, w, data=jsonl(w / "d.jsonl", [{"question": "hi"}])),
                                   r"d\.jsonl:1: no field 'prompt'"),
    "grpo prompt past positions": (lambda m, w: grpo(m, w, "--max-completion-length", "31"),
        r"p\.jsonl:1: the prompt is 2 tokens; with --max-completion-length 31 it passes the model's maximum positions"),
    "grpo option without grpo": (lambda m, w: finetune(m, w, "--num-generations", "4"),
                                 r"--num-generations goes with --method grpo"),
    "chat answers past --seq-len": (  # issue 29: dropped without a count
        lambda m, w: finetune(m, w, "--chat", "--seq-len", "8", model="chat", data=CHAT),
        r"none of its 12 samples keeps a trained token within --seq-len 8"),
    # finetune: options and the model
    "seq-len past positions": (lambda m, w: finetune(m, w, "--seq-len", "64"),
                               r"--seq-len 64 is longer than the model's maximum positions \(32\)"),
    "tp 0": (lambda m, w: finetune(m, w, "--tp", "0"), r"--tp must be >= 1, got 0"),  # issue 29: a divisibility error
    "pp 0": (lambda m, w: finetune(m, w, "--pp", "0"), r"--pp must be >= 1, got 0"),
    "dp 0": (lambda m, w: finetune(m, w, "--dp", "0"), r"--dp must be >= 1, got 0"),
    "micro batch 0": (lambda m, w: finetune(m, w, "--micro-batch-size", "0"), r"--micro-batch-size must be >= 1"),
    "steps 0": (lambda m, w: finetune(m, w, "--steps", "0"), r"--steps must be >= 1, got 0"),
    "epochs 0": (lambda m, w: finetune(m, w, "--epochs", "0", steps=()), r"--epochs must be > 0, got 0"),
    "lr negative": (lambda m, w: finetune(m, w, "--lr=-1e-4"), r"--lr must be > 0, got -0\.0001"),
    "lr 0": (lambda m, w: finetune(m, w, "--lr", "0"), r"--lr must be > 0, got 0\.0"),
    "lr nan": (lambda m, w: finetune(m, w, "--lr", "nan"), r"--lr must be > 0, got nan"),
    "grad clip 0": (lambda m, w: finetune(m, w, "--grad-clip", "0"), r"--grad-clip must be > 0 .*inf: no clipping"),
    "warmup negative": (lambda m, w: finetune(m, w, "--warmup-steps=-1"), r"--warmup-steps must be >= 0, got -1"),
    "min lr ratio past 1": (lambda m, w: finetune(m, w, "--min-lr-ratio", "2"), r"--min-lr-ratio must be in \[0, 1\]"),
    "weight decay negative": (lambda m, w: finetune(m, w, "--weight-decay=-0.1"), r"--weight-decay must be >= 0"),
    "lora dropout 1": (lambda m, w: finetune(m, w, "--lora-r", "4", "--lora-dropout", "1"),
                       r"--lora-dropout must be in \[0, 1\)"),
    "eval interval negative": (lambda m, w: finetune(m, w, "--eval-interval=-1"), r"--eval-interval must be >= 0"),
    "sample tokens 0": (lambda m, w: finetune(m, w, "--sample-tokens", "0"), r"--sample-tokens must be >= 1, got 0"),
    "global batch not divisible": (lambda m, w: finetune(m, w, "--micro-batch-size", "3", "--global-batch-size", "8"),
                                   r"global batch 8 is not divisible by micro batch x dp = 3 x 1"),
    "lora-r 0": (lambda m, w: finetune(m, w, "--lora-r", "0"), r"--lora-r must be >= 1, got 0"),
    "lora alpha without lora": (lambda m, w: finetune(m, w, "--lora-alpha", "8"), r"--lora-alpha needs LoRA"),
    "merge without lora": (lambda m, w: finetune(m, w, "--merge"), r"--merge needs LoRA: pass --lora-r"),
    "chat for a classifier": (lambda m, w: finetune(m, w, "--chat", "--task", "seqcls"), r"--chat trains causal LMs"),
    "truncate without chat": (lambda m, w: finetune(m, w, "--truncate", "tokens"),
                              r"--truncate tokens goes with --chat"),
    "eval fraction 1": (lambda m, w: finetune(m, w, "--eval-fraction", "1"), r"--eval-fraction must be in \[0, 1\)"),
    "plan auto with tp": (lambda m, w: finetune(m, w, "--plan", "auto", "--tp", "2"), r"drop --tp"),
    "model missing": (lambda m, w: finetune(m, w, model=w / "no" / "such"),
                      r"no checkpoint at .*no/such \(no such directory\)"),
    "model unknown": (lambda m, w: finetune(m, w, model="gpt-17"), r"unknown model 'gpt-17'"),
    "model without a tokenizer": (lambda m, w: finetune(m, w, model="bare"), r"no tokenizer in the model directory"),
    "output under a file": (lambda m, w: finetune(m, w, output=write(w / "f", "x") / "run"),
                            r"cannot write to the output directory"),
    "nproc 0": (lambda m, w: finetune(m, w, "--nproc-per-node", "0"), r"--nproc-per-node must be >= 1, got 0"),
    "world not divisible": (lambda m, w: finetune(m, w, "--nproc-per-node", "3", "--tp", "2"),
                            r"world size 3 is not divisible by tp\*pp\*cp = 2\*1\*1"),
    "heads over tp, before launching": (lambda m, w: finetune(m, w, "--nproc-per-node", "3", "--tp", "3"),  # issue 29
                                        r"tp=3 must divide the attention heads \(n_head\) \(4\)"),
    "layers over pp, before launching": (lambda m, w: finetune(m, w, "--nproc-per-node", "3", "--pp", "3"),
                                         r"cannot split 2 layers over 3 stages"),
    "seq-len past positions, before launching": (lambda m, w: finetune(m, w, "--nproc-per-node", "2", "--seq-len",
                                                                      "64"), r"--seq-len 64 is longer"),  # issue 29
    "seq-len over cp, before launching": (lambda m, w: finetune(m, w, "--nproc-per-node", "2", "--cp", "2",
                                                                 "--seq-len", "30"),
                                          r"--seq-len 30 must be a multiple of 4 \(cp=2, tp=1\)"),
    "resume onto another base": (resumable, r"continues a run that started from other weights"),  # issue 29
    # generate
    "no prompt": (lambda m, w: generate(m, w), r"give at least one --prompt or a --prompt-file"),
    "empty prompt": (lambda m, w: generate(m, w, "--prompt", ""), r"the prompt is empty"),  # issue 29: a traceback
    "blank prompt": (lambda m, w: generate(m, w, "--prompt", "x", "--prompt", "  "), r"--prompt number 2: the prompt"),
    "prompt file missing": (lambda m, w: generate(m, w, "--prompt-file", str(w / "p.txt")), r"p\.txt does not exist"),
    "prompt file empty": (lambda m, w: generate(m, w, "--prompt-file", str(write(w / "p.txt", "\n\n"))),
                          r"--prompt-file .*p\.txt is empty"),
    "prompt record without prompt": (  # issue 29: KeyError: 'prompt'
        lambda m, w: generate(m, w, "--prompt-file", str(jsonl(w / "p.jsonl", [{"prompt": "a"}, {"text": "b"}]))),
        r"p\.jsonl:2: no field 'prompt' \(the record is \['text'\]\)"),
    "prompt file Latin-1": (lambda m, w: generate(m, w, "--prompt-file", str(write(w / "p.txt", "olé".encode(
        "latin-1")))), r"p\.txt:1: not UTF-8 \(byte 0xE9 at line 1, column 3\)"),
    "prompt record not JSON": (lambda m, w: generate(m, w, "--prompt-file", str(write(w / "p.jsonl", "{x\n"))),
                               r"p\.jsonl:1: not valid JSON"),
    "prompt record a number": (lambda m, w: generate(m, w, "--prompt-file", str(jsonl(w / "p.jsonl", [{"prompt": 3}]))),
                               r"p\.jsonl:1: field 'prompt' is 3, not a string"),
    "temperature negative": (lambda m, w: generate(m, w, "--prompt", "a", "--temperature", "-1"),
                             r"--temperature must be >= 0, got -1"),
    "greedy and top-k": (lambda m, w: generate(m, w, "--prompt", "a", "--temperature", "0", "--top-k", "5"),
                         r"--temperature 0 is greedy decoding"),
    "top-p past 1": (lambda m, w: generate(m, w, "--prompt", "a", "--top-p", "1.5"), r"--top-p must be in \(0, 1\]"),
    "top-k 0": (lambda m, w: generate(m, w, "--prompt", "a", "--top-k", "0"), r"--top-k must be >= 1, got 0"),
    "max new tokens 0": (lambda m, w: generate(m, w, "--prompt", "a", "--max-new-tokens", "0"),
                         r"--max-new-tokens must be >= 1"),
    "generate tp 0": (lambda m, w: generate(m, w, "--prompt", "a", "--tp", "0"), r"--tp must be >= 1, got 0"),
    "generate heads over tp, before launching": (
        lambda m, w: generate(m, w, "--prompt", "a", "--nproc-per-node", "3", "--tp", "3"),
        r"tp=3 must divide the attention heads"),
    "generate world and degrees": (lambda m, w: generate(m, w, "--prompt", "a", "--nproc-per-node", "2"),
                                   r"world size 2 != pp\*dp\*cp\*tp = 1\*1\*1\*1 = 1"),
    "system without chat": (lambda m, w: generate(m, w, "--prompt", "a", "--system", "s"),
                            r"--system goes with --chat"),
    "chat without a template ": (lambda m, w: generate(m, w, "--prompt", "a", "--chat"),
                                 r"--chat needs a tokenizer with a chat template"),
    "adapter not one": (lambda m, w: generate(m, w, "--prompt", "a", "--adapter", str(w)),
                        r"is not a PEFT adapter directory"),
    "generate model missing": (lambda m, w: ["generate", str(w / "no" / "such"), "--prompt", "a"],
                               r"no checkpoint at .*no/such \(no such directory\)"),
    "generate without a tokenizer": (lambda m, w: generate(m, w, "--prompt", "a", model="bare"),
                                     r"no tokenizer found with"),
    "prompt past positions": (lambda m, w: generate(m, w, "--prompt", "a", "--max-new-tokens", "40"),
                              r"plus --max-new-tokens 40 is longer than the model's maximum positions \(32\)"),
    # eval
    "eval unknown task": (lambda m, w: ["eval", str(m["gpt2"]), "--tasks", "colozoo_mcq"],
                          r"unknown task 'colozoo_mcq'; did you mean colozoo_mc"),
    "eval task data missing": (lambda m, w: ["eval", str(m["gpt2"]), "--tasks", "mine", "--include-path",
                                             str(eval_task(w, w / "gone.jsonl"))],
                               r"task mine: its data did not load: .*gone\.jsonl"),
    "eval a model without a causal LM head": (lambda m, w: ["eval", str(tiny_bert(w)), "--tasks", "colozoo_mc"],
                                              r"bert is a BertForMaskedLM .* not a causal language model"),
    "eval include path missing": (lambda m, w: ["eval", str(m["gpt2"]), "--tasks", "colozoo_mc", "--include-path",
                                                str(w / "nope")], r"--include-path .*nope is not a directory"),
    "eval limit 0": (lambda m, w: ["eval", str(m["gpt2"]), "--tasks", "colozoo_mc", "--limit", "0"],
                     r"--limit must be a whole number of requests or a fraction"),
    "eval heads over tp, before launching": (
        lambda m, w: ["eval", str(m["gpt2"]), "--tasks", "colozoo_mc", "--nproc-per-node", "3", "--tp", "3"],
        r"tp=3 must divide the attention heads"),
    "eval ranks not a multiple of tp x pp": (
        lambda m, w: ["eval", str(m["gpt2"]), "--tasks", "colozoo_mc", "--nproc-per-node", "3", "--tp", "2"],
        r"world size 3 is not divisible by tp\*pp\*cp = 2\*1\*1"),
    "eval tasks unknown in finetune": (lambda m, w: finetune(m, w, "--eval-tasks", "nope"), r"unknown task 'nope'"),
    # convert
    "convert source missing": (lambda m, w: ["convert", str(w / "no" / "such"), str(w / "dst")],
                               r"no checkpoint at .*no/such \(no such directory\)"),
    "convert source not a checkpoint": (lambda m, w: ["convert", str(w), str(w / "dst")], r"is not a checkpoint"),
    "convert destination not empty": (lambda m, w: ["convert", str(m["gpt2"]), str(write(w / "dst", "x").parent)],
                                      r"already exists and is not empty"),
    "convert destination under a file": (  # issue 29: an OSError naming the temp directory beside it, a traceback
        lambda m, w: ["convert", str(m["gpt2"]), str(write(w / "f", "x") / "dst")],
        r"cannot write to the destination directory .*/f/dst: .*/f is not a directory"),
    "convert tp 0": (lambda m, w: ["convert", str(m["gpt2"]), str(w / "dst"), "--tp", "0"],
                     r"--tp must be >= 1, got 0"),
    "convert heads over tp": (lambda m, w: ["convert", str(m["gpt2"]), str(w / "dst"), "--tp", "3"],
                              r"tp=3 must divide the attention heads"),
    "convert LoRA run to HF": (lambda m, w: ["convert", lora_checkpoint(m), str(w / "dst"), "--to-hf"],  # issue 29
                               r"holds LoRA adapters, .*pass --merge-lora"),
    "merge without to-hf": (lambda m, w: ["convert", lora_checkpoint(m), str(w / "dst"), "--merge-lora"],
                            r"--merge-lora goes with --to-hf"),
    "merge without adapters": (lambda m, w: ["convert", str(m["gpt2"]), str(w / "dst"), "--to-hf", "--merge-lora"],
                               r"holds no LoRA adapters to merge"),
    # profile and plan
    "profile path missing": (lambda m, w: ["profile", str(w / "no" / "such")],  # issue 29: "unknown model"
                             r"no checkpoint at .*no/such \(no such directory\)"),
    "profile unknown model": (lambda m, w: ["profile", "gpt-17"], r"unknown model 'gpt-17'"),
    # issue 29: exited 0; refused on main since (colozoo/cost, in its own words: registry.check_positions has ours)
    "profile seq-len past positions": (lambda m, w: ["profile", str(m["gpt2"]), "--seq-len", "100000"],
                                       r"--seq-len 100000 is longer than the model's maximum positions"),
    "plan seq-len past positions": (lambda m, w: ["plan", str(m["gpt2"]), "--seq-len", "100000"],
                                    r"--seq-len 100000 is longer than the model's maximum positions"),
    "profile heads over tp": (lambda m, w: ["profile", str(m["gpt2"]), "--mesh", "tp=3"],
                              r"tp=3 must divide the attention heads"),
    "profile bad mesh": (lambda m, w: ["profile", str(m["gpt2"]), "--mesh", "bogus"], r"bad mesh entry 'bogus'"),
    "plan path missing": (lambda m, w: ["plan", str(w / "no" / "such"), "--gpus", "8"], r"no checkpoint at"),
}


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_1_and_leaves_nothing(case, models, tmp_path, capfd, monkeypatch):
    from colozoo.finetune import launch

    def no_launch(*args, **kwargs):
        raise AssertionError("launched ranks for input that needs none to be refused")

    monkeypatch.setattr(launch, "launch", no_launch)
    make, message = CASES[case]
    argv = make(models, tmp_path)
    capfd.readouterr()
    before = snapshot(tmp_path)
    assert cli.main(argv) == 1
    err = capfd.readouterr().err.strip()
    assert err.count("\n") == 0 and re.search(message, err), err
    assert err.startswith(f"colozoo {argv[0]}: error: ")
    assert snapshot(tmp_path) == before  # no output directory or cache left, half-written or whole


# refused from the options and the files alone: before a tokenizer, a model config or a rank, without torch
BEFORE_THE_MODEL = ["data missing", "data empty", "data a bad directory", "eval data missing", "model missing",
                    "model unknown", "steps 0", "epochs 0", "lr negative", "lr 0", "lr nan", "grad clip 0",
                    "warmup negative", "min lr ratio past 1", "weight decay negative", "lora dropout 1",
                    "eval interval negative", "sample tokens 0", "micro batch 0", "tp 0"]


def test_cheap_checks_refuse_before_the_model_is_read(models, tmp_path, capfd, monkeypatch):
    from colozoo.finetune import data, inputs

    def too_late(*args, **kwargs):
        raise AssertionError("the model or its tokenizer was read before the cheap checks")

    for name in ("check_model_and_mesh", "model_source"):
        monkeypatch.setattr(inputs, name, too_late)
    monkeypatch.setattr(data, "load_tokenizer", too_late)
    for case in BEFORE_THE_MODEL:
        make, message = CASES[case]
        work = tmp_path / case.replace(" ", "-")
        work.mkdir()
        capfd.readouterr()
        assert cli.main(make(models, work)) == 1, case
        assert re.search(message, capfd.readouterr().err), case


@pytest.mark.parametrize("case", ["data empty", "lr negative"])
def test_cheap_checks_refuse_in_a_process_that_never_imports_torch(case, models, tmp_path):
    import subprocess

    argv = CASES[case][0](models, tmp_path)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "colozoo.cli", *argv], capture_output=True,
                          text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert proc.returncode == 1 and len(lines) == 1 and re.search(CASES[case][1], lines[0]), proc.stderr[-2000:]
    assert "colozoo" in imported and not {"torch", "transformers"} & imported


ISSUE_ROWS = [  # what issue 29 found wrong, each a row above
    "fewer samples than a global batch", "chat answers past --seq-len", "tp 0", "heads over tp, before launching",
    "seq-len past positions, before launching", "resume onto another base", "empty prompt",
    "prompt record without prompt", "generate heads over tp, before launching", "convert LoRA run to HF",
    "profile path missing", "profile seq-len past positions", "convert destination under a file"]


def test_the_table_has_every_row_of_the_issue_and_the_cases_that_already_passed():
    assert set(ISSUE_ROWS) <= set(CASES) and len(CASES) - len(ISSUE_ROWS) >= 50


def subcommand_parsers() -> dict:
    parser = cli.build_parser()
    found = {}
    for action in parser._actions:
        found.update(getattr(action, "choices", None) or {})
    return found


@pytest.mark.parametrize("command", ["models", "convert", "finetune", "generate", "eval", "profile", "plan"])
def test_help_shows_every_default_once(command):
    """Every option with a default says it in --help, exactly once (not "(default: greedy) (default: None)")."""
    import argparse

    parser = subcommand_parsers()[command]
    missing, doubled = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        text = parser._get_formatter()._expand_help(action) if action.help else ""
        shown = action.default not in (None, False, argparse.SUPPRESS) or action.choices is not None and \
            action.default is not None
        if shown and "default" not in text:
            missing.append(action.option_strings[0])
        if text.count("default") > 1:
            doubled.append(action.option_strings[0])
    assert not missing and not doubled, (missing, doubled)
