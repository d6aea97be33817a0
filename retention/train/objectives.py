"""The training objectives behind one interface, so the loop (:mod:`retention.train.loop`) reads the same for each.

An objective owns what differs between them: the budget (and its words for the card), the data (packed rows or
one item a step) and its stream, the module that runs the teacher and student passes, the step's counts and the
loss. Two ship: ``loss.objective: distill`` (:class:`retention.train.distill.DistillObjective`: soft decay inside
attention, KL plus a capacity loss) and ``evict`` (:class:`retention.train.evict.EvictObjective`: KL over a relaxed
global top-B of each item's context).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from retention.attach import RetentionAttachment, unwrap
from retention.budget import streams_of

from .config import Config

if TYPE_CHECKING:
    from accelerate import Accelerator


class StepLoss(NamedTuple):
    """One micro-batch's loss (with grad) and its parts: ``kl`` and ``capacity`` (scalars), ``stats`` (the record's
    numbers: soft cache entries, budget, ...) and the student's ``log_betas`` (per layer ``(B, H_kv, T)``)."""

    loss: torch.Tensor
    kl: torch.Tensor
    capacity: torch.Tensor
    stats: dict[str, Any]
    log_betas: list[torch.Tensor]


class Objective(ABC):
    """What a training objective tells the loop. Built once the model and gates are attached; :meth:`use` hands it
    the module and LM head as ``accelerate`` prepared them, before the first :meth:`losses`."""

    rows_word = "rows"  # what one held-out unit is called in messages

    def __init__(self, cfg: Config, model: nn.Module, attachment: RetentionAttachment,
                 accelerator: Accelerator) -> None:
        self.cfg, self.model, self.attachment, self.accelerator = cfg, model, attachment, accelerator
        gc = attachment.gates.config
        self.streams = streams_of(gc.num_layers, gc.num_kv_heads)
        self.budget_text = self.describe_budget(cfg, self.streams)
        self.lm_head: nn.Module = unwrap(model).get_output_embeddings()
        self.distiller: nn.Module | None = None

    # -- what the card says (no model needed: an export of an unfinished run calls these too) ------------------
    @classmethod
    @abstractmethod
    def describe_budget(cls, cfg: Config, streams: int) -> str:
        """The training budget in words, for the log and the exported card."""

    @classmethod
    def card_budget(cls, cfg: Config, streams: int) -> str:
        """The budget as an exported unfinished run's card states it."""
        return cls.describe_budget(cfg, streams)

    @classmethod
    def card_facts(cls, cfg: Config) -> dict[str, str]:
        """Lines the card adds about the objective itself (none by default)."""
        return {}

    # -- data and passes -------------------------------------------------------------------------------------
    @abstractmethod
    def load_data(self, processor: Any) -> tuple[list, list, Any]:
        """Train rows, held-out rows and the resumable stream the loop draws micro-batches from (``next_batch``,
        ``state_dict``, ``load_state_dict``)."""

    @abstractmethod
    def module(self) -> nn.Module:
        """The module one forward of which runs both passes (what DDP / DeepSpeed wrap)."""

    def use(self, distiller: nn.Module, lm_head: nn.Module) -> None:
        """The prepared module and the LM head to score with (a whole copy under ZeRO-3)."""
        self.distiller, self.lm_head = distiller, lm_head

    @abstractmethod
    def step_counts(self, batches: list) -> dict[str, float]:
        """This rank's count for each mean over a step's micro-batches (``kl``, ``capacity``, ``ce``)."""

    @abstractmethod
    def losses(self, batch: Any, weighted: bool = True, counts: dict[str, float] | None = None) -> StepLoss:
        """The loss of one micro-batch. ``weighted=False``: held-out (the plain mean KL, comparable whatever the
        sources' weights). ``counts``: the step's :meth:`step_counts`, for a training micro-batch (else the
        batch's own means)."""

    @abstractmethod
    def held_out_batch(self, rows: list, start: int) -> Any:
        """The held-out micro-batch that starts at row ``start``."""

    @abstractmethod
    def row_tokens(self, rows: list) -> float:
        """Tokens one training row (or item) holds on average, for the tokens-per-step count."""

    @abstractmethod
    def data_text(self, train_rows: list, eval_rows: list) -> str:
        """The data and budget in the run's opening line."""

    # -- shared arithmetic -----------------------------------------------------------------------------------
    def global_mean(self, total: torch.Tensor, count: float, accumulated: int = 1) -> torch.Tensor:
        """Sum over this rank / count over all ranks, times the world size (DDP averages gradients): the gradient
        equals one process's pooled mean over the same global batch. ``count``: the whole step's (all
        ``accumulated`` micro-batches'), whose losses accelerate divides by ``accumulated``."""
        acc = self.accelerator
        n = acc.reduce(torch.tensor(float(count), device=acc.device), "sum")
        # counts may be weights < 1
        return total * (acc.num_processes * accumulated) / torch.where(n > 0, n, torch.ones_like(n))
