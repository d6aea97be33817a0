"""Metrics: answer recall for generated replies; KL and top-1 agreement for fidelity."""

from __future__ import annotations

import re

import torch


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.lower()).strip()


def answer_recall(output: str, answers: list[str]) -> float:
    """Percentage of the expected answers that appear in the output (case- and space-insensitive)."""
    if not answers:
        raise ValueError("an item without answers cannot be scored by answer recall")
    out = _norm(output)
    return 100.0 * sum(_norm(a) in out for a in answers) / len(answers)


def kl_and_top1(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Mean ``KL(p_ref || p)`` (nats) and top-1 agreement (%) over positions; logits ``(T, V)``."""
    ref = torch.log_softmax(reference_logits.float(), -1)
    cur = torch.log_softmax(logits.float(), -1)
    kl = (ref.exp() * (ref - cur)).sum(-1).mean()
    top1 = (ref.argmax(-1) == cur.argmax(-1)).float().mean() * 100
    return float(kl), float(top1)
