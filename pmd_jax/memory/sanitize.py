"""Model-written text is data: normalise, strip control tokens and role markers, cap lengths.

Every string the memory stores or puts in a teacher prompt passes ``sanitize_text``:

1. drop lone surrogates and undecodable bytes; NFKC-normalise (so full-width look-alikes such
   as ``＜｜im_start｜＞`` become ASCII and are caught below);
2. remove invisible format characters (zero-width, bidi overrides) and C0/C1 controls other
   than newline and tab (so ``<|im\u200b_start|>`` is caught below);
3. repeatedly remove control tokens until nothing changes, so that tokens split by other
   tokens (``<|im_<|x|>start|>``) cannot re-form. The tokens are the *tokenizer's own*:
   ``control_tokens``, the strings of every special token and every markup-like added token of
   the student/teacher tokenizer plus its chat template's control strings, which whoever builds
   the memory passes in as plain strings (``memory.context.extra_control_tokens``; the trainer
   sets it from ``Tokenizer.special_tokens``). Only when no list is given does the small,
   family-independent ``FALLBACK_CONTROL_TOKENS`` list apply. Matching covers each token's
   NFKC form and, for markup tokens (not plain words), any case; the generic ``<|...|>`` form
   is always removed;
4. remove role markers at the start of lines (``system:``, ``Assistant:``, ``### User:``) and
   role words alone on a line (what ``<|im_start|>system`` leaves behind);
5. collapse runs of blank lines and cut to ``max_chars``.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterable, Sequence

# Used only when no tokenizer's list is given (a memory built without a tokenizer, e.g. in
# tools and tests): common literal control tokens of chat templates (Qwen, OLMo, Llama-2,
# Mistral, Gemma, StarCoder/SmolLM2 vocab) beyond the generic <|...|> form.
FALLBACK_CONTROL_TOKENS: tuple[str, ...] = (
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


def _token_forms(tokens: tuple[str, ...]) -> list[str]:
    """Each token and its NFKC form (text is NFKC-normalised before matching), longest first;
    empty and whitespace-only strings are dropped (stripping them would eat layout)."""
    forms: set[str] = set()
    for t in tokens:
        if not isinstance(t, str):
            continue
        for f in (t, unicodedata.normalize("NFKC", t)):
            if f.strip():
                forms.add(f)
    return sorted(forms, key=lambda s: (-len(s), s))


@functools.lru_cache(maxsize=64)
def _token_regex_cached(tokens: tuple[str, ...]) -> re.Pattern[str]:
    """Markup tokens (``<|im_start|>``, ``|||IP_ADDRESS|||``) match in any case; a token that is
    a plain word matches in its own case only (as the tokenizer matches it), so stripping it
    cannot eat the same word in other cases."""
    toks = _token_forms(tokens)
    markup = [re.escape(t) for t in toks if not re.fullmatch(r"\w+", t)]
    words = [re.escape(t) for t in toks if re.fullmatch(r"\w+", t)]
    alts = ([f"(?i:{'|'.join(markup)})"] if markup else []) + words
    if not alts:
        return re.compile(r"(?!x)x")  # matches nothing
    return re.compile("|".join(alts))


def _control_regex(control_tokens: Sequence[str]) -> re.Pattern[str]:
    """The tokenizer's tokens if any were given, else the family-independent fallback."""
    return _token_regex(control_tokens) if control_tokens else _FALLBACK_RE


_FALLBACK_RE = _token_regex(FALLBACK_CONTROL_TOKENS)


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
    text: str, control_tokens: Sequence[str] = (), max_rounds: int = 64
) -> str:
    """Removes control tokens until a fixpoint; a token split by another cannot re-form.

    ``control_tokens``: the tokenizer's special/added token strings; empty means the fallback
    list ``FALLBACK_CONTROL_TOKENS``. The generic ``<|...|>`` form is always removed.
    """
    token_re = _control_regex(control_tokens)
    for _ in range(max_rounds):
        new = _GENERIC_TOKEN.sub("", text)
        new = token_re.sub("", new)
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
    control_tokens: Sequence[str] = (),
    *,
    drop_thinking: bool = False,
) -> str:
    """Returns safe text of at most ``max_chars`` characters ('' for non-strings).

    ``control_tokens``: the strings of the tokenizer's special and added tokens (see the module
    doc); empty means the family-independent fallback list.
    """
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
        new = strip_control_tokens(text, control_tokens)
        new = _ROLE_HEADER.sub("", new)
        new = _ROLE_LINE.sub("", new)
        new = _ROLE_MARKER.sub("", new)
        if new == text:
            break
        text = new
    else:
        text = strip_control_tokens(text, control_tokens)
    text = _BLANKS.sub("\n\n", text).strip()
    if len(text) > max_chars:
        text = text[:max_chars].rstrip()
        # A cut may leave a partial token prefix such as "<|im_"; harmless, but trim it.
        text = re.sub(r"<\|?[^<>\s]{0,80}$", "", text).rstrip()
    return text


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


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", unicodedata.normalize("NFKC", text).lower())


ECHO_MIN_WORDS = 5  # shorter texts (a name, "test the code") are not called echoes


def echoes_prompt(text: str, prompt: str, min_words: int = ECHO_MIN_WORDS) -> bool:
    """True if ``text`` is a copy of the call's own instructions: its words (lower-cased,
    punctuation dropped), at least ``min_words`` of them, occur as one run in ``prompt``'s.
    A small model asked to extract behaviors often hands the request back ("Keep them
    high-level and transferable to new problems of this kind.")."""
    w = _words(text)
    if len(w) < min_words:
        return False
    return f" {' '.join(w)} " in f" {' '.join(_words(prompt))} "


def resanitize(text: str, control_tokens: Sequence[str]) -> str:
    """A stored item sanitised again, uncut, against this memory's control tokens.

    Items were sanitised when stored; doing it again as they enter a teacher context covers a
    state restored from a memory that was built with another tokenizer's list (or none). On an
    item already clean it is the identity.
    """
    return sanitize_text(text, max(len(text), 1), control_tokens)


def without_shared_preamble(texts: dict[str, str]) -> dict[str, str]:
    """The problem texts without the leading paragraphs they all share.

    A task's prompt may open with the same instructions for every problem (the code tasks:
    ``tasks.code.CODE_PROMPT``'s "You are a coding expert. ..." before the problem). Where the
    behavior level shows a problem in a few hundred characters (the extractive summary's
    examples, the summary and extraction prompts' evidence), that preamble filled the space
    and the problem itself was cut off. Removed here: the longest prefix common to every text,
    cut back to its last paragraph break (a blank line), so a word the problems happen to share
    at their start is kept. Fewer than two texts, or no shared paragraph, leave them as given
    (the question-answering tasks start with the question)."""
    values = [t for t in texts.values() if t]
    if len(values) < 2:
        return dict(texts)
    lo, hi = min(values), max(values)  # the common prefix of all = that of min and max
    n = next((i for i, (a, b) in enumerate(zip(lo, hi, strict=False)) if a != b), len(lo))
    cut = lo.rfind("\n\n", 0, n)
    if cut < 0:
        return dict(texts)
    cut += 2
    return {k: (t[cut:] if len(t) > cut else t) for k, t in texts.items()}
