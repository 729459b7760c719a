"""Model-written text is data: normalise, strip control tokens and role markers, cap lengths.

Every string the memory stores or puts in a teacher prompt passes ``sanitize_text``:

1. drop lone surrogates and undecodable bytes; NFKC-normalise (so full-width look-alikes such
   as ``＜｜im_start｜＞`` become ASCII and are caught below);
2. remove invisible format characters (zero-width, bidi overrides) and C0/C1 controls other
   than newline and tab;
3. repeatedly remove chat-template control tokens (``<|...|>``, ``<think>``, ``[INST]``,
   ``<start_of_turn>``, ...) until nothing changes, so that tokens split by other tokens
   (``<|im_<|x|>start|>``) cannot re-form;
4. remove role markers at the start of lines (``system:``, ``Assistant:``, ``### User:``) and
   role words alone on a line (what ``<|im_start|>system`` leaves behind);
5. collapse runs of blank lines and cut to ``max_chars``.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterable, Sequence

# Literal special tokens of the chat templates we target (Qwen2/3, OLMo-2/3 (Tulu), Llama-2/3,
# Mistral, Gemma, DeepSeek, Phi, SmolLM2 / StarCoder vocab), beyond the generic <|...|> form.
KNOWN_CONTROL_TOKENS: tuple[str, ...] = (
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<s>", "</s>", "<unk>", "<pad>", "<bos>", "<eos>", "<mask>",
    "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
    "<repo_name>", "<reponame>", "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>",
    "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>",
    "<jupyter_output>", "<jupyter_script>", "<empty_output>",
    "[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]",
)

# <|anything|> (Qwen, OLMo/Tulu, Llama-3, Phi) and DeepSeek's <｜...｜> (NFKC maps ｜ to |, but
# keep the raw form too in case normalisation is bypassed).
_GENERIC_TOKEN = re.compile(r"<\|[^<>\n]{0,80}?\|>|<｜[^<>\n]{0,80}?｜>")
_ROLE_WORDS = r"(?:system|user|assistant|human|tool|developer|ipython)"
_ROLE_MARKER = re.compile(
    rf"^[ \t>#*]*(?:{_ROLE_WORDS}|\[{_ROLE_WORDS}\])[ \t]*:[ \t]*",
    re.IGNORECASE | re.MULTILINE,
)
_ROLE_HEADER = re.compile(
    rf"^[ \t]*#+[ \t]*(?:{_ROLE_WORDS}|instruction|response|input)[ \t]*:?[ \t]*$",
    re.IGNORECASE | re.MULTILINE,
)
# A role word alone on a line: what remains of "<|im_start|>system\n" after token removal.
_ROLE_LINE = re.compile(rf"^[ \t]*{_ROLE_WORDS}[ \t]*$\n?", re.IGNORECASE | re.MULTILINE)
_BLANKS = re.compile(r"\n[ \t]*\n(?:[ \t]*\n)+")
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def _token_regex(tokens: Iterable[str]) -> re.Pattern[str]:
    return _token_regex_cached(tuple(tokens))


@functools.lru_cache(maxsize=64)
def _token_regex_cached(tokens: tuple[str, ...]) -> re.Pattern[str]:
    toks = sorted({t for t in tokens if t}, key=len, reverse=True)
    if not toks:
        return re.compile(r"(?!x)x")  # matches nothing
    return re.compile("|".join(re.escape(t) for t in toks), re.IGNORECASE)


_KNOWN_RE = _token_regex(KNOWN_CONTROL_TOKENS)


_INVISIBLE: re.Pattern[str] | None = None


def _invisible_re() -> re.Pattern[str]:
    """Character class of every Cc/Cf/Cs code point except newline and tab (built once)."""
    global _INVISIBLE
    if _INVISIBLE is None:
        ranges: list[tuple[int, int]] = []
        for cp in range(0x110000):
            if cp in (0x09, 0x0A):
                continue
            if unicodedata.category(chr(cp)) in ("Cc", "Cf", "Cs"):
                if ranges and ranges[-1][1] == cp - 1:
                    ranges[-1] = (ranges[-1][0], cp)
                else:
                    ranges.append((cp, cp))
        body = "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)
        _INVISIBLE = re.compile(f"[{body}]")
    return _INVISIBLE


def _drop_invisible(text: str) -> str:
    text = text.replace("\u2028", "\n").replace("\u2029", "\n").replace("\r\n", "\n")
    return _invisible_re().sub("", text)


def strip_control_tokens(
    text: str, extra_tokens: Sequence[str] = (), max_rounds: int = 64
) -> str:
    """Removes control tokens until a fixpoint; a token split by another cannot re-form."""
    extra_re = _token_regex(extra_tokens) if extra_tokens else None
    for _ in range(max_rounds):
        new = _GENERIC_TOKEN.sub("", text)
        new = _KNOWN_RE.sub("", new)
        if extra_re is not None:
            new = extra_re.sub("", new)
        if new == text:
            return text
        text = new
    # Pathological nesting deeper than max_rounds: neutralise every angle/pipe bracket.
    return re.sub(r"[<>|\[\]]", " ", text)


def strip_thinking(text: str) -> str:
    """Removes ``<think>...</think>`` blocks (SDPO does this to demonstrations)."""
    return _THINK_BLOCK.sub("", text)


def sanitize_text(
    text: object,
    max_chars: int,
    extra_tokens: Sequence[str] = (),
    *,
    drop_thinking: bool = False,
) -> str:
    """Returns safe text of at most ``max_chars`` characters ('' for non-strings)."""
    if not isinstance(text, str):
        return ""
    # Work on a bounded prefix: huge inputs cannot cost more than a few times max_chars.
    text = text[: max(4 * max_chars, 256)]
    text = text.encode("utf-8", "ignore").decode("utf-8", "ignore")
    text = unicodedata.normalize("NFKC", text)
    text = _drop_invisible(text)
    if drop_thinking:
        text = strip_thinking(text)
    for _ in range(8):
        new = strip_control_tokens(text, extra_tokens)
        new = _ROLE_HEADER.sub("", new)
        new = _ROLE_LINE.sub("", new)
        new = _ROLE_MARKER.sub("", new)
        if new == text:
            break
        text = new
    else:
        text = strip_control_tokens(text, extra_tokens)
    text = _BLANKS.sub("\n\n", text).strip()
    if len(text) > max_chars:
        text = text[:max_chars].rstrip()
        # A cut may leave a partial token prefix such as "<|im_"; harmless, but trim it.
        text = re.sub(r"<\|?[^<>\s]{0,80}$", "", text).rstrip()
    return text


def contains_control_token(text: str, extra_tokens: Sequence[str] = ()) -> bool:
    if _GENERIC_TOKEN.search(text) or _KNOWN_RE.search(text):
        return True
    return bool(extra_tokens) and _token_regex(extra_tokens).search(text) is not None


def leaks_gold(text: str, leak_strings: Sequence[str]) -> bool:
    """True if ``text`` contains a gold-answer string.

    Matching is case-insensitive and on word boundaries where the leak string starts/ends with
    a word character, so the leak "B" matches "option B" but not "Bohr". A one-character leak
    (an option letter) is matched case-sensitively ("B" matches "B)" but not "a b c").
    """
    for leak in leak_strings:
        if not isinstance(leak, str):
            continue
        leak = unicodedata.normalize("NFKC", leak).strip()
        if not leak:
            continue
        pat = re.escape(leak)
        if re.match(r"\w", leak):
            pat = r"(?<!\w)" + pat
        if re.search(r"\w$", leak):
            pat = pat + r"(?!\w)"
        flags = 0 if len(leak) == 1 else re.IGNORECASE
        if re.search(pat, text, flags):
            return True
    return False
