"""Evaluation: long-context tasks, a resumable sweep runner over policies x budgets, reports and plots.

    python -m retention.eval run --config eval/configs/smollm2.yaml
    python -m retention.eval report runs/eval/smollm2/results.jsonl
"""
