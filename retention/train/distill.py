"""The distillation objective (``loss.objective: distill``, the paper's): a teacher pass with the gates bypassed and a
student pass with retention-gated attention (every past token decayed by ``beta^(t-i)``) over packed rows; the loss
is ``KL(teacher || student)`` plus ``loss.capacity_weight`` times the capacity loss against the budget (and,
optionally, ``loss.ce_weight`` times the student's next-token cross-entropy).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from retention.attach import RetentionAttachment, unwrap
from retention.budget import capacity_target, training_entries
from retention.losses import capacity_loss, capacity_terms, distillation_kl
from retention.models import cache_dir

from .config import Config
from .data import PackedStream, build_data, collate_any
from .multimodal_data import build_multimodal, shows_images
from .objectives import Objective, StepLoss


class Distiller(nn.Module):
    """One forward = teacher pass + student pass, so DDP / DeepSpeed see a single module call.

    Returns final hidden states ``(B, T, D)`` of both passes and the student's ``log_beta`` per layer.
    """

    def __init__(self, model: nn.Module, attachment: RetentionAttachment) -> None:
        super().__init__()
        self.model = model
        self.attachment = attachment

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                **extra: Any) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        decoder = unwrap(self.model).model  # the transformer without the LM head
        kw = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        # with LoRA co-training the teacher is the original model: adapters off as well as gates
        no_adapter = getattr(self.model, "disable_adapter", None)
        with torch.no_grad(), self.attachment.teacher(), (no_adapter() if no_adapter else contextlib.nullcontext()):
            h_teacher = decoder(**kw).last_hidden_state
        with self.attachment.student():
            h_student = decoder(**kw).last_hidden_state
        return h_student, h_teacher, self.attachment.log_betas()


def mrope_positions(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """M-RoPE positions ``(3, B, T)`` of a packed multimodal row, from the model's own rule.

    Computed over the whole row: a later conversation's positions are shifted by a constant in all
    three axes, which leaves its attention unchanged (RoPE sees only differences, and the packing
    keeps conversations from attending to each other)."""
    inner = unwrap(model).model
    pos, _ = inner.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                  image_grid_thw=batch.get("image_grid_thw"))
    return pos


def capacity_budget_text(cfg: Config, streams: int) -> str:
    """The capacity budget in words: per KV head for TRIM-KV's per-head form, else one total for the model."""
    total = training_entries(cfg.budget.tokens_per_head, cfg.budget.global_entries, streams)
    if cfg.loss.capacity_form == "per_head":
        return f"{total / streams:g} entries per KV head ({total} in all)"
    return f"{total} entries in all ({total / streams:g} per KV head on average)"


class DistillObjective(Objective):
    """KL plus capacity over packed rows of ``data.seq_len`` tokens (text, or multimodal conversations)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        b = self.cfg.budget
        # the capacity loss's M: the whole model's entries, or their share per KV head (per_head form)
        self.budget = capacity_target(training_entries(b.tokens_per_head, b.global_entries, self.streams),
                                      self.streams, self.cfg.loss.capacity_form)

    @classmethod
    def describe_budget(cls, cfg: Config, streams: int) -> str:
        return capacity_budget_text(cfg, streams)

    @classmethod
    def card_budget(cls, cfg: Config, streams: int) -> str:
        return f"{capacity_budget_text(cfg, streams)}, capacity {cfg.loss.capacity_form}"

    def load_data(self, processor: Any) -> tuple[list, list, PackedStream]:
        cfg, acc = self.cfg, self.accelerator
        if any(shows_images(s) for s in cfg.data.sources):
            train_rows, eval_rows = build_multimodal(cfg.data, processor, cache=cache_dir() / "data")
        else:
            tokenizer = getattr(processor, "tokenizer", processor)
            train_rows, eval_rows = build_data(cfg.data, tokenizer, cache=cache_dir() / "data")
        stream = PackedStream(train_rows, cfg.train.batch_size, cfg.data.seed, acc.process_index, acc.num_processes)
        return train_rows, eval_rows, stream

    def module(self) -> Distiller:
        return Distiller(self.model, self.attachment)

    def step_counts(self, batches: list) -> dict[str, float]:
        """Distilled positions (or their weights), capacity terms and cross-entropy targets. Each micro-batch's sum
        is divided by the step's count, not its own, so batch_size 1 x grad_accum 2 trains as batch_size 2 on the
        same rows (a micro-batch's own mean gave a row of few distilled positions, or of a lightly weighted source,
        as much say as a full one)."""
        kl = cap = ce = 0.0
        for batch in batches:
            mask, weight = batch["loss_mask"], batch.get("loss_weight")
            kl += float(mask.sum()) if weight is None else float(weight[mask].sum())
            B, T = mask.shape
            cap += int(capacity_terms(batch["cu_seqlens"], B, self.streams, T, self.budget,
                                      self.cfg.loss.capacity_form, batch.get("capacity_mask"))[1].sum())
            ce += float(mask[:, :-1].sum())
        return {"kl": kl, "capacity": cap, "ce": ce}

    def losses(self, batch: dict[str, torch.Tensor], weighted: bool = True,
               counts: dict[str, float] | None = None) -> StepLoss:
        cfg, lm_head, mean = self.cfg, self.lm_head, self.global_mean
        accumulated = cfg.train.grad_accum if counts else 1
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        vision = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in batch}
        # packed rows carry positions restarting in each document (the teacher's block-diagonal mask and
        # the student's document boundaries come from them)
        position_ids = batch["position_ids"]
        if "mm_token_type_ids" in batch:  # Qwen3-VL: text positions on top of the M-RoPE (t, h, w) rows
            position_ids = torch.cat([position_ids[None], mrope_positions(self.model, batch)])
        h_s, h_t, log_betas = self.distiller(batch["input_ids"], position_ids, **vision)
        kl_sum, kl_n = distillation_kl(
            h_s, h_t, lm_head, batch["loss_mask"], cfg.loss.kl_temperature, cfg.loss.kl_chunk, reduction="sum",
            weights=batch.get("loss_weight") if weighted else None,
        )
        cap_sum, cap_stats = capacity_loss(log_betas, self.budget, cfg.loss.capacity_form, batch["cu_seqlens"],
                                           reduction="sum", mask=batch.get("capacity_mask"))
        kl = mean(kl_sum, counts["kl"] if counts else kl_n, accumulated)
        cap = mean(cap_sum, counts["capacity"] if counts else cap_stats["capacity_terms"], accumulated)
        loss = kl + cfg.loss.capacity_weight * cap
        if cfg.loss.ce_weight:
            ce = nn.functional.cross_entropy(
                lm_head(h_s[:, :-1]).flatten(0, 1).float(), batch["input_ids"][:, 1:].flatten(), reduction="none"
            )
            m = batch["loss_mask"][:, :-1].flatten().float()
            loss = loss + cfg.loss.ce_weight * mean((ce * m).sum(), counts["ce"] if counts else int(m.sum()),
                                                    accumulated)
        return StepLoss(loss, kl, cap, cap_stats, log_betas)

    def held_out_batch(self, rows: list, start: int) -> dict[str, torch.Tensor]:
        return collate_any(rows[start : start + self.cfg.train.batch_size])

    def row_tokens(self, rows: list) -> float:
        return self.cfg.data.seq_len

    def data_text(self, train_rows: list, eval_rows: list) -> str:
        return (f"budget {self.budget_text}; {len(train_rows)} train / {len(eval_rows)} held-out rows of "
                f"{self.cfg.data.seq_len} tokens")
