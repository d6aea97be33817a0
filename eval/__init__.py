"""Evaluation: long-context tasks, a resumable sweep runner over policies x budgets, reports and plots.

    python -m eval run --config eval/configs/smollm2.yaml
    python -m eval report runs/eval/smollm2/results.jsonl
"""
