"""What `colozoo generate` prints while a batch decodes: each sequence's text in prompt order, the first one token by
token; the next one catches up with what it has so far as soon as the one before it ends, then streams on.

It takes transformers' streamer calls (`put(prompt ids)`, then `put(one token per sequence)` each step, `end()`).
Text is decoded from the prompt and the new tokens together and the prompt's decoding cut off, so a tokenizer that
spells a word's leading space into its token (SentencePiece, byte-level BPE) keeps it. A sequence ends at an end
token or at the first of the stop strings, which is not printed; text that might be the start of a stop string
waits until it is clear.
"""
from __future__ import annotations

import sys


class OrderedStreamer:
    def __init__(self, tokenizer, prompt_ids: list[list[int]], echo: list[str] | None = None,
                 stop_strings: list[str] | None = None, eos_token_ids=(), out=None):
        """`prompt_ids`: each sequence's prompt tokens, padding left out; `echo`: the prompts as the user wrote them,
        printed before their continuation (None: the new text only, from its first non-space character)."""
        self.tokenizer, self.prompt_ids, self.echo = tokenizer, prompt_ids, echo
        self.stops = [s for s in (stop_strings or []) if s]
        self.eos = set(eos_token_ids)
        self.out = out or sys.stdout
        self.prompt_text = [self._decode(ids) for ids in prompt_ids]
        self.new = [[] for _ in prompt_ids]
        self.ended = [False] * len(prompt_ids)
        self.started, self.current, self.printed = False, 0, None

    def put(self, value):
        if not self.started:  # the prompts themselves
            self.started = True
            return
        for row, token in enumerate(value.reshape(-1).tolist()):
            if self.ended[row]:
                continue
            if token in self.eos:
                self.ended[row] = True
            else:
                self.new[row].append(token)
        self._show()

    def end(self):
        self.ended = [True] * len(self.ended)
        self._show()

    def texts(self) -> list[str]:
        """Every sequence's new text as printed (stop strings cut off)."""
        return [self.text(row)[0] for row in range(len(self.new))]

    def text(self, row: int) -> tuple[str, bool]:
        """(the row's new text, whether it is complete: ended, or cut at a stop string)."""
        full = self._decode(self.prompt_ids[row] + self.new[row])
        prompt = self.prompt_text[row]
        text = full[len(prompt):] if full.startswith(prompt) else self._decode(self.new[row])
        if self.echo is None:  # a reply alone starts at its first word, whatever space the tokenizer put before it
            text = text.lstrip()
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts:
            return text[:min(cuts)], True
        return text, self.ended[row]

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _show(self):
        while self.current < len(self.new):
            row = self.current
            if self.printed is None:  # this sequence's turn begins
                self.printed = ""
                if self.echo is not None:
                    self._write(self.echo[row])
            text, complete = self.text(row)
            if not complete:
                text = self._settled(text)
            if text.startswith(self.printed):
                self._write(text[len(self.printed):])
                self.printed = text
            if not complete:
                return
            self._write("\n" if row == len(self.new) - 1 else "\n\n")
            self.current, self.printed = row + 1, None

    def _settled(self, text: str) -> str:
        """What of an unfinished text can be printed: not a trailing partial character, nor a tail that may be the
        start of a stop string."""
        text = text.rstrip("\ufffd")
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    text = text[:-k]
                    break
        return text

    def _write(self, text: str):
        if text:
            self.out.write(text)
            self.out.flush()
