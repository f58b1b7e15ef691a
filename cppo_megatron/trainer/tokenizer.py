"""Tokenizers behind one small interface: a character tokenizer built in code (no
download, for from-scratch models) and a wrapper around an HF tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    """One token per character of ``alphabet`` (or per byte when alphabet is None)."""

    def __init__(self, alphabet: str | None = None) -> None:
        self.byte_level = alphabet is None
        chars = [chr(i) for i in range(256)] if alphabet is None else list(dict.fromkeys(alphabet))
        self.itos = list(SPECIALS) + chars
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        if self.byte_level:
            return [self.stoi[chr(b)] for b in text.encode("utf-8")]
        try:
            return [self.stoi[c] for c in text]
        except KeyError as exc:
            raise ValueError(
                f"character {exc.args[0]!r} in {text[:40]!r} is not in the tokenizer alphabet "
                f"{''.join(self.itos[len(SPECIALS):])!r}"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        chars = [self.itos[i] for i in ids if i >= len(SPECIALS)]
        if self.byte_level:
            return bytes(ord(c) for c in chars).decode("utf-8", errors="replace")
        return "".join(chars)

    def prompt_ids(self, question: str) -> list[int]:
        return [self.bos_id] + self.encode(question)

    def state(self) -> dict:
        return {"kind": "char", "alphabet": None if self.byte_level else "".join(self.itos[len(SPECIALS):])}


class HFTokenizer:
    """An HF tokenizer; questions optionally wrapped in its chat template."""

    def __init__(self, tok, *, chat_template: bool = False, system_prompt: str | None = None) -> None:
        self.tok = tok
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        if tok.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; generation could never stop")
        self.eos_id = tok.eos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.bos_id = tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def prompt_ids(self, question: str) -> list[int]:
        if self.chat_template:
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
                {"role": "user", "content": question}
            ]
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tok.encode(text, add_special_tokens=False)
        ids = self.encode(question)
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def state(self) -> dict:
        return {"kind": "hf"}
