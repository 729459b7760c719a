"""A small tokenizer wrapper over a HF fast tokenizer, with the model's chat format.

``encode_chat`` renders messages with the Python chat renderers in ``chat.py`` and encodes
the result (control strings such as ``<|im_start|>`` become their single special ids).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pmd_jax.models import chat as chat_lib

_STOP_STRINGS = (chat_lib.IM_END, chat_lib.ENDOFTEXT)


def _is_markup(s: str) -> bool:
    """A string with a non-space, non-word character (``<x>``, ``|||y|||``), not a plain word."""
    return any(not (c.isalnum() or c.isspace() or c == "_") for c in s)


class TokenizerError(ValueError):
    """A tokenizer folder or file cannot be used; the message names the file or token."""


def guess_chat_format(chat_template: str | None) -> str:
    """The chat format a HF ``chat_template`` is (models/chat.py's registry decides)."""
    return chat_lib.guess_chat_format(chat_template)


class Tokenizer:
    """Encode/decode plus the ids a sampler needs (eos, pad, stop) and the chat format."""

    def __init__(self, hf: Any, chat_format: str | None = None):
        self.hf = hf
        self.chat_format = chat_format or guess_chat_format(getattr(hf, "chat_template", None))
        if self.chat_format not in chat_lib.chat_format_names():
            raise TokenizerError(
                f"unknown chat format {self.chat_format!r}; known {chat_lib.chat_format_names()}"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, chat_format: str | None = None) -> Tokenizer:
        """A local folder with tokenizer.json (+ tokenizer_config.json); no network."""
        # lazy: transformers (heavy, torch-backed) only when a HF tokenizer is loaded
        from transformers import AutoTokenizer

        p = Path(path)
        if not (p / "tokenizer.json").exists():
            raise TokenizerError(f"{p}: no tokenizer.json")
        hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        return cls(hf, chat_format)

    @classmethod
    def from_files(
        cls,
        tokenizer_json: str | os.PathLike,
        tokenizer_config: str | os.PathLike | None = None,
        chat_format: str | None = None,
    ) -> Tokenizer:
        """From a tokenizer.json and optional tokenizer_config.json (special tokens, template)."""
        # lazy: transformers (heavy, torch-backed) only when a HF tokenizer is loaded
        from transformers import PreTrainedTokenizerFast

        conf: dict[str, Any] = {}
        if tokenizer_config is not None:
            conf = json.loads(Path(tokenizer_config).read_text())
        kw = {k: conf[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token",
                                     "chat_template") if conf.get(k) is not None}
        kw = {k: (v["content"] if isinstance(v, dict) else v) for k, v in kw.items()}
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), **kw)
        return cls(hf, chat_format)

    # ------------------------------------------------------------------ ids
    def token_id(self, token: str) -> int | None:
        tid = self.hf.convert_tokens_to_ids(token)
        if tid is None or (self.hf.unk_token_id is not None and tid == self.hf.unk_token_id
                           and token != self.hf.unk_token):
            return None
        return int(tid)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_id(self) -> int | None:
        im_end = self.token_id(chat_lib.IM_END)
        return im_end if im_end is not None else self.hf.eos_token_id

    @property
    def pad_id(self) -> int | None:
        pad = self.hf.pad_token_id
        return pad if pad is not None else self.eos_id

    @property
    def stop_ids(self) -> list[int]:
        ids = [self.token_id(s) for s in _STOP_STRINGS]
        if self.hf.eos_token_id is not None:
            ids.append(self.hf.eos_token_id)
        out: list[int] = []
        for i in ids:
            if i is not None and i not in out:
                out.append(i)
        return out

    @property
    def special_tokens(self) -> list[str]:
        """Every control string of this tokenizer, for stripping model text used as data.

        The tokenizer's own tokens, not a hand list: every special token (``all_special_tokens``
        and each added token flagged special), every other added token that is markup rather
        than a word (``<think>``, ``<tool_call>``, ``<functions>``, ``|||IP_ADDRESS|||``: a
        non-special added token still encodes to its single id), and the chat format's control
        strings that this vocabulary has. Whitespace-only and plain-word added tokens are left
        out (stripping them would eat layout or words).
        """
        out = {s for s in self.hf.all_special_tokens if isinstance(s, str) and s.strip()}
        for tok in self.hf.added_tokens_decoder.values():
            s = tok.content
            if s.strip() and (tok.special or _is_markup(s)):
                out.add(s)
        out.update(s for s in chat_lib.get_chat_format(self.chat_format).control_strings
                   if self.token_id(s) is not None)
        return sorted(out)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def strip_special(self, text: str) -> str:
        for s in sorted(self.special_tokens, key=len, reverse=True):
            text = text.replace(s, "")
        return text

    # ------------------------------------------------------------------ chat
    def render_chat(
        self,
        messages: Sequence[chat_lib.Message],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = False,
    ) -> str:
        return chat_lib.render(self.chat_format, messages, add_generation_prompt, enable_thinking)

    def encode_chat(
        self,
        messages: Sequence[chat_lib.Message],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = False,
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, enable_thinking))

    def apply_jinja_template(
        self, messages: Sequence[chat_lib.Message], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        """The tokenizer's own Jinja chat template through transformers (reference rendering)."""
        if not getattr(self.hf, "chat_template", None):
            raise TokenizerError("this tokenizer has no chat_template")
        return self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kw
        )

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        """tokenizer.json, tokenizer_config.json (with the chat template) and friends."""
        self.hf.save_pretrained(str(path))
