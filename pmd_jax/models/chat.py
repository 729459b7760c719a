"""Chat templates rendered in Python: ChatML (SmolLM2), Qwen2.5, Qwen3 (thinking on/off), OLMo-3
Instruct.

Each renderer reproduces the model's official Jinja chat template for plain text messages
(roles system / user / assistant, plus tool turns where the template has them); the tests
compare against the official templates through ``transformers``' ``apply_chat_template``.
Tool *definitions* and tool calls are not rendered (this project does not use them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pmd_jax.registry import Registry

Message = Mapping[str, Any]

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
OLMO3_DEFAULT_SYSTEM = (
    "You are a helpful function-calling AI assistant. "
    "You do not currently have access to any functions. <functions></functions>"
)
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# Strings that only ever appear as chat-template structure (each format's: ChatFormat.
# control_strings); model-written text that is reused as data (memory) has them stripped.


class ChatError(ValueError):
    """Malformed chat messages; the message names the offending entry."""


def _check(messages: Sequence[Message], roles: Sequence[str]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatError(f"messages must be a list of {{'role', 'content'}} dicts, got "
                        f"{type(messages).__name__}")
    if not messages:
        raise ChatError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatError(f"messages[{i}] is a {type(m).__name__}, not a dict")
        role, content = m.get("role"), m.get("content")
        if role not in roles:
            raise ChatError(f"messages[{i}] has role {role!r}; this template accepts {list(roles)}")
        if not isinstance(content, str):
            raise ChatError(f"messages[{i}] ({role}) content must be a string, got "
                            f"{type(content).__name__}")
        out.append(dict(m))
    return out


def render_chatml(
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    default_system: str | None = SMOLLM2_DEFAULT_SYSTEM,
) -> str:
    """SmolLM2-Instruct's template (from its GGUF metadata): ChatML + a default system turn."""
    msgs = _check(messages, ("system", "user", "assistant"))
    parts: list[str] = []
    if default_system is not None and msgs[0]["role"] != "system":
        parts.append(f"{IM_START}system\n{default_system}{IM_END}\n")
    for m in msgs:
        parts.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def _tool_response(msgs: Sequence[Message], i: int) -> list[str]:
    """Qwen's rendering of tool message ``i``: a ``<tool_response>`` block inside a user turn
    that consecutive tool messages share."""
    out = [f"{IM_START}user"] if i == 0 or msgs[i - 1]["role"] != "tool" else []
    out.append(f"\n<tool_response>\n{msgs[i]['content']}\n</tool_response>")
    if i == len(msgs) - 1 or msgs[i + 1]["role"] != "tool":
        out.append(f"{IM_END}\n")
    return out


def _is_tool_response(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


def render_qwen3(
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = False,
) -> str:
    """Qwen3's template. ``enable_thinking=False`` adds the empty think block to the generation
    prompt (the official "non-thinking" mode); ``True``/``None`` leave it to the model.

    Assistant turns before the last user query lose their reasoning; later ones keep it as
    ``<think>\\n...\\n</think>\\n\\n`` (from ``reasoning_content`` or a ``<think>`` in content).
    """
    msgs = _check(messages, ("system", "user", "assistant", "tool"))
    parts: list[str] = []
    if msgs[0]["role"] == "system":
        parts.append(f"{IM_START}system\n{msgs[0]['content']}{IM_END}\n")
    last_query = len(msgs) - 1
    for idx in range(len(msgs) - 1, -1, -1):
        m = msgs[idx]
        if m["role"] == "user" and not _is_tool_response(m["content"]):
            last_query = idx
            break
    for i, m in enumerate(msgs):
        role, content = m["role"], m["content"]
        if role == "user" or (role == "system" and i != 0):
            parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        elif role == "assistant":
            reasoning = ""
            rc = m.get("reasoning_content")
            if rc is not None:
                reasoning = rc
            elif THINK_CLOSE in content:
                before, _, _ = content.partition(THINK_CLOSE)
                content = content.split(THINK_CLOSE)[-1].lstrip("\n")
                reasoning = before.rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
            is_last = i == len(msgs) - 1
            if i > last_query and (is_last or reasoning):
                parts.append(f"{IM_START}assistant\n{THINK_OPEN}\n{reasoning.strip(chr(10))}\n"
                             f"{THINK_CLOSE}\n\n{content.lstrip(chr(10))}")
            else:
                parts.append(f"{IM_START}assistant\n{content}")
            parts.append(f"{IM_END}\n")
        elif role == "tool":
            parts += _tool_response(msgs, i)
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
        if enable_thinking is False:
            parts.append(f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n")
    return "".join(parts)


def render_qwen25(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """Qwen2.5 Instruct (Qwen2.5-Coder too): ChatML with Qwen's default system turn when the
    first message is not a system message; tool results are user turns in
    ``<tool_response>`` blocks, consecutive ones sharing a turn."""
    msgs = _check(messages, ("system", "user", "assistant", "tool"))
    parts: list[str] = []
    if msgs[0]["role"] != "system":
        parts.append(f"{IM_START}system\n{QWEN25_DEFAULT_SYSTEM}{IM_END}\n")
    for i, m in enumerate(msgs):
        role, content = m["role"], m["content"]
        if role == "tool":
            parts += _tool_response(msgs, i)
        else:
            parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def render_olmo3(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """OLMo-3 Instruct: ChatML with a default function-calling system turn when the first
    message is not a system message; a final assistant turn ends with ``<|endoftext|>``."""
    msgs = _check(messages, ("system", "user", "assistant", "environment", "tool"))
    parts: list[str] = []
    if msgs[0]["role"] != "system":
        parts.append(f"{IM_START}system\n{OLMO3_DEFAULT_SYSTEM}{IM_END}\n")
    for i, m in enumerate(msgs):
        role, content = m["role"], m["content"]
        if role == "system":
            fn = m.get("functions")
            extra = f" <functions>{fn}</functions>" if fn is not None else ""
            parts.append(f"{IM_START}system\n{content}{extra}{IM_END}\n")
        elif role == "user":
            parts.append(f"{IM_START}user\n{content}{IM_END}\n")
        elif role in ("environment", "tool"):
            parts.append(f"{IM_START}environment\n{content}{IM_END}\n")
        else:
            end = ENDOFTEXT if i == len(msgs) - 1 else f"{IM_END}\n"
            parts.append(f"{IM_START}assistant\n{content}{end}")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


# ----------------------------------------------------------------------------- the registry
@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """One chat format: how it renders, the strings that are only its structure, and how a HF
    ``chat_template`` is recognized as it (the tokenizer's guess when the config says "auto").
    Adding a format is its renderer and one :func:`register_chat_format` call."""

    name: str
    # (messages, add_generation_prompt, enable_thinking) -> the prompt text
    render: Callable[[Sequence[Message], bool, bool | None], str]
    control_strings: tuple[str, ...]
    # whether a HF chat_template is this format's; the guess asks the formats by ascending
    # guess_rank (the more specific first; a fallback that accepts any template last)
    recognizes: Callable[[str], bool] = lambda template: False
    guess_rank: int = 50


FORMATS: Registry[ChatFormat] = Registry(
    "chat format", lambda name, known: ChatError(f"unknown chat format {name!r}; known {known}"))


def register_chat_format(fmt: ChatFormat) -> ChatFormat:
    return FORMATS.register(fmt.name, fmt)


def get_chat_format(name: str) -> ChatFormat:
    return FORMATS.get(name)


def chat_format_names() -> tuple[str, ...]:
    return FORMATS.names()


def guess_chat_format(chat_template: str | None) -> str:
    """The registered format (by ascending ``guess_rank``) whose ``recognizes`` first
    accepts ``chat_template``."""
    t = chat_template or ""
    for fmt in sorted(FORMATS.values(), key=lambda f: f.guess_rank):
        if fmt.recognizes(t):
            return fmt.name
    raise ChatError("no chat format recognizes this chat template (register a fallback)")


_TOOLS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
register_chat_format(ChatFormat(  # SmolLM2's; the guess's fallback
    "chatml", lambda m, g, _t: render_chatml(m, g), (IM_START, IM_END, ENDOFTEXT),
    lambda t: True, guess_rank=100))
register_chat_format(ChatFormat(
    "qwen2.5", lambda m, g, _t: render_qwen25(m, g), (IM_START, IM_END, ENDOFTEXT, *_TOOLS),
    lambda t: "You are Qwen, created by Alibaba Cloud" in t, guess_rank=2))
register_chat_format(ChatFormat(
    "qwen3", render_qwen3, (IM_START, IM_END, ENDOFTEXT, THINK_OPEN, THINK_CLOSE, *_TOOLS),
    lambda t: "enable_thinking" in t or "reasoning_content" in t, guess_rank=0))
register_chat_format(ChatFormat(
    "olmo3", lambda m, g, _t: render_olmo3(m, g),
    (IM_START, IM_END, ENDOFTEXT, "<functions>", "</functions>", "<function_calls>",
     "</function_calls>"),
    lambda t: "function-calling" in t or "environment" in t, guess_rank=1))

CHAT_FORMATS: tuple[str, ...] = chat_format_names()
CONTROL_STRINGS: dict[str, tuple[str, ...]] = {f.name: f.control_strings
                                               for f in FORMATS.values()}


def render(
    chat_format: str,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = False,
) -> str:
    return get_chat_format(chat_format).render(messages, add_generation_prompt, enable_thinking)


def strip_control(text: str, chat_format: str = "chatml", extra: Sequence[str] = ()) -> str:
    """Remove chat-template control strings (model-written text reused as data)."""
    own = get_chat_format(chat_format).control_strings if chat_format in FORMATS else ()
    for s in own + tuple(extra):
        text = text.replace(s, "")
    return text
