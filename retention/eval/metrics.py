"""Metrics on hand-checkable definitions.

Generated replies: ``recall`` (share of the reference strings found in the reply as whole numbers or words: the
generated tasks' metric), ``substring`` (RULER's own string match, a plain substring test: the Hub RULER set's),
``f1`` (SQuAD/LongBench token F1, best over references), ``rouge_l`` (LCS-based F-measure on words), ``choice`` (the
letter of a multiple-choice answer), ``edit_sim`` (character similarity of the first non-comment code line, as
LongBench's code tasks). Fidelity: KL(full || compressed) and
top-1 agreement of next-token distributions. Scores are percentages.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from difflib import SequenceMatcher
from typing import Callable

import torch


def normalize(s: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's answer normalisation)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _run(ch: str) -> str:
    """The ASCII characters that would run on from ``ch`` into a longer number or word (none for other ``ch``)."""
    return "0-9" if ch.isascii() and ch.isdigit() else "a-z" if ch.isascii() and ch.isalpha() else ""


def _contains(text: str, answer: str) -> bool:
    """Whether ``answer`` (lower case) is in ``text`` (lower case) with no digit running on from an edge digit of it
    and no letter from an edge letter."""
    # a plain substring found the needle 1332323 in the reply 13323233333 and the name Ada in "Your name is Adam":
    # a longer number or word is another one
    first, last = _run(answer[:1]), _run(answer[-1:])
    before, after = (f"(?<![{first}])" if first else ""), (f"(?![{last}])" if last else "")
    return re.search(before + re.escape(answer) + after, text) is not None


def _share_found(reply: str, answers: list[str], found: Callable[[str, str], bool], name: str) -> float:
    if not answers:
        raise ValueError(f"{name} needs at least one reference answer")
    out = " ".join(reply.lower().split())
    return 100.0 * sum(found(out, " ".join(a.lower().split())) for a in answers) / len(answers)


def recall(reply: str, answers: list[str]) -> float:
    """Percentage of the reference strings contained in the reply (case- and spacing-insensitive); a reference
    does not count inside a longer number or word (a letter beside a digit, or punctuation, ends either)."""
    return _share_found(reply, answers, _contains, "recall")


def substring(reply: str, answers: list[str]) -> float:
    """RULER's ``string_match_all``: percentage of the reference strings that are substrings of the reply
    (case-insensitive), so "59195816" holds 9195816. For the Hub RULER set, whose published scores use it."""
    return _share_found(reply, answers, lambda out, a: a in out, "substring")


def _f1(pred: list[str], ref: list[str]) -> float:
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(ref)
    return 2 * p * r / (p + r)


def f1(reply: str, answers: list[str]) -> float:
    """Token F1 of the normalised reply against the best-matching reference."""
    return 100.0 * max(_f1(normalize(reply).split(), normalize(a).split()) for a in answers)


def _lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(reply: str, answers: list[str]) -> float:
    """ROUGE-L F-measure (beta = 1) on normalised words, best over references."""
    best = 0.0
    pred = normalize(reply).split()
    for a in answers:
        ref = normalize(a).split()
        lcs = _lcs(pred, ref)
        if lcs:
            p, r = lcs / len(pred), lcs / len(ref)
            best = max(best, 2 * p * r / (p + r))
    return 100.0 * best


def extract_choice(reply: str) -> str | None:
    """The multiple-choice letter a reply commits to: ``(B)``, ``answer is C``, or a bare leading letter."""
    # the phrase in any case, the letter a capital: re.I read "the answer is a bit unclear" as (A)
    m = re.search(r"\(([ABCD])\)", reply) or re.search(r"(?i:answer is):?\s*\(?([ABCD])\b", reply) \
        or re.match(r"\s*([ABCD])\b", reply)
    return m.group(1).upper() if m else None


def choice(reply: str, answers: list[str]) -> float:
    """100 if the extracted letter equals the reference letter (``answers[0]``, e.g. ``"C"``)."""
    return 100.0 * (extract_choice(reply) == answers[0].strip("() ").upper())


def edit_sim(reply: str, answers: list[str]) -> float:
    """Character similarity of the reply's first code line with the reference (LongBench lcc/repobench)."""
    lines = [ln for ln in reply.lstrip("\n").splitlines()
             if ln.strip() and not ln.lstrip().startswith(("#", "//", "`"))]
    first = lines[0] if lines else ""
    return 100.0 * max(SequenceMatcher(None, first, a).ratio() for a in answers)


METRICS: dict[str, Callable[[str, list[str]], float]] = {
    "recall": recall, "substring": substring, "f1": f1, "rouge_l": rouge_l, "choice": choice, "edit_sim": edit_sim,
}


def score_reply(metric: str, reply: str, answers: list[str]) -> float:
    """Score a reply with a metric by name."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; available: {sorted(METRICS)}")
    if not answers:  # f1, choice and edit_sim failed inside max() or on [0]; rouge_l scored 0 without a word
        raise ValueError(f"{metric} needs at least one reference answer; this item has none")
    return METRICS[metric](reply, answers)


def kl_and_top1(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Mean ``KL(p_ref || p)`` in nats and top-1 agreement (%) over positions; logits ``(T, V)``."""
    if reference_logits.shape != logits.shape or logits.dim() != 2:
        # (1, V) against (T, V) broadcast silently: every reference position scored against one distribution
        raise ValueError(f"kl_and_top1 needs two (positions, vocab) logits of one shape, got reference "
                         f"{tuple(reference_logits.shape)} and {tuple(logits.shape)}")
    ref = torch.log_softmax(reference_logits.float(), -1)
    cur = torch.log_softmax(logits.float(), -1)
    kl = (ref.exp() * (ref - cur)).sum(-1).clamp_min(0).mean()
    top1 = (ref.argmax(-1) == cur.argmax(-1)).float().mean() * 100
    return float(kl), float(top1)


def register_metric(name: str, fn: Callable[[str, list[str]], float]) -> None:
    """Add a metric by name (e.g. a judged score): ``fn(reply, references) -> percentage``."""
    METRICS[name] = fn
