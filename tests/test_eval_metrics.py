"""Metrics and budgets on hand-made cases."""

import math

import pytest
import torch

from retention.eval.budgets import Budget, parse_budget
from retention.eval.metrics import choice, edit_sim, extract_choice, f1, kl_and_top1, recall, rouge_l, score_reply


def test_recall():
    assert recall("The number is 4512.", ["4512"]) == 100.0
    assert recall("It is 12 and  MEADOW", ["meadow", "12", "99"]) == pytest.approx(200 / 3)
    assert recall("nothing", ["4512"]) == 0.0
    # a multi-value needle: one point in three for each number recalled, wherever it stands in the reply
    vals = ["9517692", "4638762", "8633385"]
    assert recall(" 8633385 and 9517692", vals) == pytest.approx(200 / 3)
    # neither another number ending in its digits nor a prefix of the right one counts
    assert recall("1816", ["9517692"]) == 0.0 and recall("The number is 951769.", ["9517692"]) == 0.0
    with pytest.raises(ValueError):
        recall("x", [])


def test_f1_and_rouge_l():
    assert f1("The Eiffel Tower", ["eiffel tower"]) == 100.0
    # pred: [paris, france], ref: [paris] -> p = 1/2, r = 1 -> F1 = 2/3
    assert f1("Paris, France.", ["Paris"]) == pytest.approx(200 / 3)
    assert f1("london", ["Paris", "london"]) == 100.0 and f1("rome", ["Paris"]) == 0.0
    # LCS of [cat sat on mat] and [cat lay on mat] is 3 -> p = r = 3/4
    assert rouge_l("the cat sat on the mat", ["a cat lay on the mat"]) == pytest.approx(75.0)
    assert rouge_l("", ["x"]) == 0.0


def test_choice_and_edit_sim():
    assert extract_choice("The correct answer is (C).") == "C"
    assert extract_choice("answer is B because") == "B"
    assert extract_choice("D") == "D" and extract_choice("no idea") is None
    assert choice(" (B)", ["B"]) == 100.0 and choice("(A)", ["B"]) == 0.0
    assert edit_sim("# comment\nreturn x + 1\n", ["return x + 1"]) == 100.0
    assert 0 < edit_sim("return x", ["return x + 1"]) < 100
    with pytest.raises(ValueError, match="unknown metric"):
        score_reply("bleu", "a", ["a"])


def test_kl_and_top1():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    kl, top1 = kl_and_top1(logits, logits)
    assert kl == pytest.approx(0.0, abs=1e-7) and top1 == 100.0
    kl, top1 = kl_and_top1(logits, torch.tensor([[0.0, 2.0], [0.0, 1.0]]))
    p = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    want = float((p * (p.log() - torch.log_softmax(torch.tensor([0.0, 2.0]), 0))).sum()) / 2
    assert kl == pytest.approx(want, rel=1e-5) and top1 == 50.0
    # by hand: p = (e^2, 1)/(e^2+1) vs q = (1, e^2)/(e^2+1): KL = (p0 - p1) * 2
    p0 = math.exp(2) / (math.exp(2) + 1)
    assert want == pytest.approx((p0 - (1 - p0)) * 2 / 2, rel=1e-5)


def test_budgets():
    assert parse_budget(0.1) == Budget("fraction", 0.1) == parse_budget("10%") == parse_budget({"fraction": 0.1})
    assert parse_budget({"entries": 2000}) == parse_budget("2000 entries") == parse_budget("entries=2000")
    assert parse_budget({"tokens": 64}).entries(1000, streams=90) == 64 * 90
    assert parse_budget(0.25).entries(1000, streams=90) == 22500
    assert parse_budget({"entries": 5000}).entries(10, 90) == 5000
    assert parse_budget(0.1).label == "10%" and parse_budget(0.1).key == "fraction=0.1"
    for bad in (64, 0, -0.5, "lots", {"entries": -1}, {"tokens": 1, "entries": 2}, True, {"fraction": 2}):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)


def test_budget_keys_of_large_counts_read_back():
    """``:g`` wrote 1,234,567 entries as ``entries=1.23457e+06``: a key that parse_budget refused (so report, pool
    and publish failed on the sweep's rows) and that 1,234,570 entries shared."""
    from retention.eval.report import budget_label

    big = parse_budget({"entries": 1234567})
    assert big.key == "entries=1234567" and parse_budget(big.key) == big
    assert budget_label(big.key) == "1234567 entries"
    assert parse_budget({"entries": 1234570}).key != big.key
    tokens = parse_budget({"tokens": 2_000_000})
    assert parse_budget(tokens.key) == tokens and tokens.label == "2000000 tok/head"
    tiny = parse_budget("0.005%")  # :g writes it fraction=5e-05
    assert parse_budget(tiny.key) == tiny and budget_label(tiny.key) == "0.005%"


@pytest.mark.parametrize("spec", [{"tokens": 64.5}, {"entries": 100.7}, {"entries": float("inf")}])
def test_budget_counts_must_be_whole(spec):
    """entries() cut 64.5 tokens per head to 64 while the row's key said tokens=64.5."""
    with pytest.raises(ValueError, match="must be a whole number"):
        parse_budget(spec)
    assert parse_budget({"tokens": 64.0}).key == "tokens=64"


def test_kl_and_top1_refuses_logits_of_another_shape():
    """A (1, V) against (T, V) broadcast: each reference position was scored against the one distribution."""
    ref = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match=r"one shape, got reference \(3, 2\) and \(1, 2\)"):
        kl_and_top1(ref, ref[:1])
    with pytest.raises(ValueError, match="one shape"):
        kl_and_top1(ref[None], ref[None])  # a batch dimension left on


def test_recall_does_not_find_a_number_inside_a_longer_one():
    """A reply of 13323233333 held the needle 1332323 as a substring and scored 100: a longer number is another
    number. Digits next to the answer's digits rule it out; punctuation, letters or spaces beside it do not."""
    assert recall(" 13323233333333333333333", ["1332323"]) == 0.0
    assert recall(":\n\n1. 86333858\n2. 863338", ["8633385"]) == 0.0
    assert recall("The 7053354433543543435", ["7053354"]) == 0.0
    assert recall("x 01332323 x", ["1332323"]) == 0.0 and recall("0123", ["123"]) == 0.0
    assert recall("0123", ["0123"]) == 100.0 and recall("(1332323).", ["1332323"]) == 100.0
    assert recall("is: 1332323, and 99", ["1332323"]) == 100.0 and recall("no.1332323st", ["1332323"]) == 100.0
    # a multi-value reply: the number standing alone counts, the one inside a longer number does not
    assert recall("1. 7440635\n2. 74406361", ["7440635", "7440636"]) == pytest.approx(50.0)
    # LongBench's passage_count and passage_retrieval_en (scored by recall) compare whole numbers
    assert recall("There are 13 unique paragraphs.", ["3"]) == 0.0 and recall("Paragraph 12", ["Paragraph 1"]) == 0.0
    assert recall("Paragraph 1.", ["Paragraph 1"]) == 100.0
    assert recall("VAR ABCDE and XYZQW", ["abcde", "xyzqw"]) == 100.0  # words: matched as before


def test_choice_does_not_read_the_article_a_as_a_letter():
    """``answer is a bit unclear`` committed to (A): the letter was matched case-insensitively with the phrase. The
    phrase still is (LongBench v2's extraction takes capital letters only)."""
    assert extract_choice("I think the answer is a bit unclear.") is None
    assert choice("so the answer is a mix of both", ["A"]) == 0.0
    assert extract_choice("The Answer is: (b)") is None and extract_choice("ANSWER IS D") == "D"
    assert extract_choice("the answer is B, since") == "B" and extract_choice("answer is (C)") == "C"


def test_substring_is_rulers_own_match_for_the_hub_ruler_set():
    """The Hub RULER set keeps RULER's plain substring test (string_match_all), so its numbers compare with the
    published ones; the generated tasks' recall reads whole numbers and words."""
    from retention.eval.metrics import score_reply

    assert score_reply("substring", ":\n\n1. 5991977\n2. 59195816", ["9195816", "5991977", "9837550"]) == (
        pytest.approx(200 / 3))
    assert score_reply("recall", ":\n\n1. 5991977\n2. 59195816", ["9195816", "5991977", "9837550"]) == (
        pytest.approx(100 / 3))
    assert score_reply("substring", "Your name is ADAM", ["ada"]) == 100.0
    with pytest.raises(ValueError, match="substring needs at least one"):
        score_reply("substring", "x", [])


def test_recall_does_not_find_a_word_inside_a_longer_word():
    """dialogue_memory's name Ada was found in "Your name is Adam" (and in "Canada"), Ines in "lines", and
    common_words' "abandon" in a list that named "abandoned": a longer word is another word."""
    assert recall("Your name is Adam.", ["Ada"]) == 0.0 and recall("You live in Canada", ["Ada"]) == 0.0
    assert recall("The lines say so", ["Ines"]) == 0.0 and recall("1. abandoned 2. abet", ["abandon", "abet"]) == 50.0
    assert recall("Your name is Ada.", ["Ada"]) == 100.0 and recall("Ada's pet", ["ada"]) == 100.0
    assert recall("VAR ABCDE = 12", ["abcde"]) == 100.0 and recall("no.1332323st", ["1332323"]) == 100.0
    assert recall("a-b!", ["a-b"]) == 100.0 and recall("xa-bx", ["a-b"]) == 0.0
    assert recall("café au lait", ["café"]) == 100.0  # edges that are not ASCII letters or digits: a plain substring


@pytest.mark.parametrize("metric", ["recall", "substring", "f1", "rouge_l", "choice", "edit_sim"])
def test_an_item_without_answers_is_a_clear_error_for_every_metric(metric):
    """f1 and edit_sim failed inside max(), choice on answers[0], and rouge_l scored 0 without a word."""
    from retention.eval.metrics import score_reply

    with pytest.raises(ValueError, match=f"{metric} needs at least one reference answer"):
        score_reply(metric, "some reply", [])
