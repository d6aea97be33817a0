"""Eviction-aware distillation: train the gates on what inference does with them.

The soft objective (``loss.objective: distill``) decays every past token by ``beta^(t-i)`` inside
attention and holds the soft cache size to the budget. Inference does something else: the context
is prefilled with full attention, the global top-B entries by ``(t - i) * log beta`` are kept and the
rest are dropped, then the question and the answer attend over what was kept. ``objective: evict``
trains exactly that, relaxed so gradients flow:

1. the teacher prefills an item's context (full attention, no grad) and scores its continuation
   (the question and reply of a retrieval item, the next tokens of a text);
2. the gates score every context entry from the same prefill's attention inputs (with grad);
3. the entries are ranked globally on ``u = -log(-(t - i) * log beta)`` (the order of the inference
   policy's score); the threshold lies halfway between the ``B``-th and the next largest ``u``, and an
   entry's soft keep weight is ``sigmoid((u - threshold) / tau)`` (sinks always kept): the policy's own
   top-B as ``tau -> 0``;
4. the student re-reads the continuation over the teacher's context cache with ``log`` of that weight
   added to each past key's attention logit (``attach`` mode ``"bias"``), and the loss is
   ``KL(teacher || student)`` over the continuation's distilled positions.

Only the continuation is recomputed with grad, so a step costs one prefill plus a short pass; the
budget is a fraction of each item's context, drawn per item from ``loss.evict_fractions``.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from retention.attach import RetentionAttachment, unwrap
from retention.budget import entries_for_fraction
from retention.compat import cache_kwargs, output_cache
from retention.losses import distillation_kl
from retention.policies import lookahead_log_score

from .objectives import Objective, StepLoss

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from retention.tasks.base import Item

    from .config import Config, DataConfig, SourceConfig

_SINK_U = 1.0e4  # rank of an always-kept sink: above any entry the gates can score
HARD_TAU = 1.0e-4  # the held-out KL's temperature: the policy's own top-B (see tests/test_train_evict.py)


@dataclass
class EvictionExample:
    """One item: ``head`` (context token ids, compressed), ``tail`` (fed after the compression) and
    ``targets`` (``len(tail)`` bools: the tail positions whose next-token distribution is distilled;
    the logits at tail position ``j`` predict ``tail[j + 1]``, the last one what follows)."""

    head: list[int]
    tail: list[int]
    targets: list[bool]
    task: str = ""
    weight: float = 1.0


def example_from_item(tokenizer: PreTrainedTokenizerBase, item: Item) -> EvictionExample:
    """Head / tail split of an eval-generator item as the query-agnostic protocol splits it.

    Retrieval and dialogue items: the tail is the question turn (chat template, generation prompt and
    answer prefix) followed by the reference answer, and the positions that predict the answer's
    tokens are distilled. Fidelity items: the tail is the continuation, every position distilled.
    """
    from retention.tasks.prompt import prompt_ids

    if item.metric == "fidelity":
        head, cont = list(item.meta["context_ids"]), list(item.meta["continuation_ids"])
        return EvictionExample(head, cont, [True] * len(cont), item.task)
    ctx, prompt = prompt_ids(tokenizer, item)
    # after an answer prefix ("... the text is") a space, as the training conversations write the reply
    # (:func:`retention.train.data.synthetic_reply`); without one the reply opens the turn, with no space
    answer = tokenizer((" " if item.answer_prefix else "") + ", ".join(item.answers),
                       add_special_tokens=False)["input_ids"]
    tail = prompt[len(ctx):] + answer
    # the last prompt position predicts the answer's first token; the last answer token predicts nothing kept
    targets = [False] * (len(prompt) - len(ctx) - 1) + [True] * len(answer) + [False]
    return EvictionExample(list(ctx), tail, targets, item.task)


def source_examples(source: SourceConfig, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> list[EvictionExample]:
    """Examples of one synthetic source (:func:`retention.train.data.synthetic_items`); :func:`load_examples` gives them
    their source's weights."""
    from tqdm.auto import tqdm

    from .data import synthetic_items

    out: list[EvictionExample] = []
    for item in tqdm(synthetic_items(source, tokenizer, seq_len), desc=f"evict {source.path}", unit="item",
                     leave=False):
        out.append(example_from_item(tokenizer, item))
    return out


def load_examples(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase,
                  cache: Path | None = None) -> tuple[list[EvictionExample], list[EvictionExample]]:
    """Train and held-out examples of a config's ``data`` (cached as JSON under ``cache``): the held-out
    ones are the last ``eval_fraction`` of each source's items, taken in turn from each source."""
    import json
    from dataclasses import asdict

    from .data import _cache_key, held_out_count

    target = None if cache is None else cache / f"evict-{_cache_key(cfg, tokenizer)}.json"
    if target is not None and target.is_file():
        # the multipliers are reset from the sources below (a cache written with rank_weight, since removed, loads)
        per_source = [[EvictionExample(**{k: v for k, v in e.items() if k != "rank_weight"}) for e in src]
                      for src in json.loads(target.read_text())]
    else:
        per_source = [source_examples(src, tokenizer, cfg.seq_len) for src in cfg.sources]
        if target is not None:
            from retention.io import atomic_write_bytes

            atomic_write_bytes(target, json.dumps([[asdict(e) for e in src] for src in per_source]).encode())
    for src, exs in zip(cfg.sources, per_source):  # the source's multipliers: they change no token
        for ex in exs:
            ex.weight = float(src.weight)
    train, held_per_source = [], []
    for exs in per_source:
        n_eval = held_out_count(len(exs), cfg.eval_fraction)
        train += exs[: len(exs) - n_eval]
        held_per_source.append(exs[len(exs) - n_eval :])
    # round robin over the sources, so the first train.eval_batches held-out items cover every task
    held = [ex for group in itertools.zip_longest(*held_per_source) for ex in group if ex is not None]
    return train, held


def eviction_u(log_betas: list[torch.Tensor], sink: int) -> list[torch.Tensor]:
    """Per layer ``(1, H, T)`` eviction rank ``u = -log(-(T - i) * log beta)`` of a ``T``-token context.

    ``u`` orders the entries as :class:`retention.policies.GlobalGatesPolicy` (horizon 1) does at step
    ``T`` (age ``T - i``, score ``age * log beta``), in log units so a temperature reads as a ratio of decay
    exponents. The first ``sink`` tokens of every head rank above anything the gates can score (always kept).
    """
    T = log_betas[0].shape[-1]
    age = torch.arange(T, 0, -1, device=log_betas[0].device, dtype=torch.float32)  # T - i
    us = []
    for lb in log_betas:
        score = lookahead_log_score(lb, age, horizon=1)
        u = -torch.log((-score).clamp_min(1e-30))
        if sink:
            u = torch.cat([torch.full_like(u[..., :sink], _SINK_U), u[..., sink:]], dim=-1)
        us.append(u)
    return us


def soft_keep_bias(log_betas: list[torch.Tensor], budget: int, sink: int,
                   tau: float) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per layer ``(1, H, T)`` additive attention bias ``log sigmoid((u - u_B) / tau)`` for a global top-B.

    ``log_betas``: per layer ``(1, H, T)`` gate scores of a ``T``-token context (<= 0), ranked by
    :func:`eviction_u`. The first ``sink`` tokens of every head are kept outright (and count in the
    budget). ``u_B``, halfway between the ``budget``-th and the next largest ``u``, is a constant (no
    gradient), so ``tau -> 0`` keeps exactly the policy's top-B. Returns the biases and statistics:
    ``soft_entries`` (the sum of soft keep weights), ``threshold_u`` and ``entries`` (all of them).
    """
    us = eviction_u(log_betas, sink)
    flat = torch.cat([u.detach().flatten() for u in us])
    budget = max(1, int(budget))
    if budget >= flat.numel():  # everything fits: keep it all
        return [torch.zeros_like(u) for u in us], {"soft_entries": float(flat.numel()), "threshold_u": float("-inf"),
                                                    "entries": float(flat.numel())}
    # halfway between the B-th and the (B+1)-th entry: the top B weigh > 1/2, the rest < 1/2
    top = torch.topk(flat, budget + 1).values
    threshold = 0.5 * (top[-2] + top[-1])
    biases = [F.logsigmoid((u - threshold) / tau) for u in us]
    soft = float(sum(b.detach().exp().sum() for b in biases))
    return biases, {"soft_entries": soft, "threshold_u": float(threshold), "entries": float(flat.numel())}


class EvictionDistiller(nn.Module):
    """One forward = teacher prefill of the head and pass over the tail, then the student's biased pass
    over the tail; a single module call so DDP sees the gates' gradients.

    Returns the tail's final hidden states ``(1, T_tail, D)`` of the student and the teacher, the
    context's per-layer ``log_beta`` ``(1, H, T_head)`` and the bias statistics.
    """

    def __init__(self, model: nn.Module, attachment: RetentionAttachment) -> None:
        super().__init__()
        self.model = model
        self.attachment = attachment

    def forward(
        self, head: torch.Tensor, tail: torch.Tensor, fraction: float, tau: float,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], dict[str, Any]]:
        att = self.attachment
        decoder = unwrap(self.model).model
        cfg = att.gates.config
        inputs: list[torch.Tensor | None] = [None] * len(att.modules)

        def grab(layer: int):
            def hook(module, args, kwargs):
                inputs[layer] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()
            return hook

        hooks = [m.register_forward_pre_hook(grab(i), with_kwargs=True) for i, m in enumerate(att.modules)]
        try:
            with torch.no_grad(), att.teacher():
                cache = output_cache(decoder(input_ids=head, use_cache=True))
        finally:
            for h in hooks:
                h.remove()
        P = head.shape[1]
        with torch.no_grad(), att.teacher():
            h_teacher = decoder(input_ids=tail, **cache_kwargs(cache), use_cache=True).last_hidden_state
        cache.crop(-tail.shape[1])  # drop the tail again: the context alone for the student's pass
        log_betas = [att.gates(i, x) for i, x in enumerate(inputs)]
        # a share of this item's context (layers and heads apart, as this count always took them; no floor of 1)
        budget = entries_for_fraction(fraction, P, cfg.num_layers, cfg.num_kv_heads, at_least=0)
        biases, stats = soft_keep_bias(log_betas, budget, att.sink, tau)
        with att.key_biases(biases):
            h_student = decoder(input_ids=tail, **cache_kwargs(cache), use_cache=True).last_hidden_state
        stats["budget"] = float(budget)
        return h_student, h_teacher, log_betas, stats


class ExampleStream:
    """Examples in a reshuffled order each epoch, resumable (``state_dict``), with each item's budget
    fraction drawn from ``fractions`` by a per-(epoch, position) seed; ranks take disjoint slices. The loop
    reads it as it reads :class:`retention.train.data.PackedStream` (``next_batch``, ``state_dict``)."""

    def __init__(self, examples: list[EvictionExample], fractions: list[float], seed: int, rank: int = 0,
                 world: int = 1):
        if not examples:
            raise ValueError("no eviction examples: objective 'evict' needs synthetic sources "
                             "(data.sources kind: synthetic)")
        self.examples, self.fractions, self.seed = examples, list(fractions), seed
        self.rank, self.world, self.position = rank, world, 0

    def next_batch(self) -> tuple[EvictionExample, float]:
        """The next ``(example, budget fraction)`` of this rank."""
        n = len(self.examples)
        k = self.position * self.world + self.rank
        epoch, i = divmod(k, n)
        order = list(range(n))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        self.position += 1
        return self.examples[order[i]], random.Random(f"{self.seed}/{epoch}/{i}/fraction").choice(self.fractions)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def evict_budget_text(cfg: Config) -> str:
    """Objective ``evict``: its budgets are shares of each item's context (``loss.evict_fractions``).

    The list is a draw (a share listed twice is drawn twice as often) whose first entry is the held-out budget,
    so the text names the distinct shares and the held-out one rather than echoing the list.
    """
    fr = cfg.loss.evict_fractions
    shares = sorted(set(fr))
    if len(shares) == 1:
        return f"global top-B of {fr[0]:.0%} of each context"
    listed = ", ".join(f"{f:.0%}" for f in shares)
    return f"global top-B of {listed} of each context (drawn per item; held out at {fr[0]:.0%})"


class EvictObjective(Objective):
    """KL over each item's continuation read over a relaxed global top-B of its context (module docstring); no
    capacity term (the top-B holds the budget)."""

    rows_word = "items"

    @classmethod
    def describe_budget(cls, cfg: Config, streams: int) -> str:
        return evict_budget_text(cfg)

    @classmethod
    def card_facts(cls, cfg: Config) -> dict[str, str]:
        loss = cfg.loss
        said = (f"eviction-aware distillation (retention/train/evict.py): each item's continuation read over a relaxed "
                f"global top-B of its prefilled context, tau {loss.evict_tau:g}, budgets "
                f"{', '.join(f'{f:g}' for f in loss.evict_fractions)} of the context; held-out KL over the hard top-B "
                f"at {loss.evict_fractions[0]:g} (not comparable with a distill stage's soft-decay KL)")
        return {"objective": said}

    def load_data(self, processor: Any) -> tuple[list, list, ExampleStream]:
        from retention.models import cache_dir

        cfg, acc = self.cfg, self.accelerator
        tokenizer = getattr(processor, "tokenizer", processor)
        train_rows, eval_rows = load_examples(cfg.data, tokenizer, cache=cache_dir() / "data")
        stream = ExampleStream(train_rows, cfg.loss.evict_fractions, cfg.data.seed, acc.process_index,
                               acc.num_processes)
        return train_rows, eval_rows, stream

    def module(self) -> EvictionDistiller:
        return EvictionDistiller(self.model, self.attachment)

    def step_counts(self, batches: list) -> dict[str, float]:
        """The distilled positions of the step's items, weighted by their sources."""
        kl = 0.0
        for example, _ in batches:
            kl += sum(example.targets) * example.weight
        return {"kl": kl, "capacity": 0.0, "ce": 0.0}

    def losses(self, batch: tuple[EvictionExample, float], weighted: bool = True,
               counts: dict[str, float] | None = None) -> StepLoss:
        """Held-out (``weighted=False``): over the hard top-B itself, what inference keeps, whatever ``evict_tau``."""
        example, fraction = batch
        cfg, dev = self.cfg, self.accelerator.device
        head, tail = torch.tensor([example.head], device=dev), torch.tensor([example.tail], device=dev)
        tau = cfg.loss.evict_tau if weighted else HARD_TAU
        mask = torch.tensor([example.targets], device=dev)
        h_s, h_t, log_betas, stats = self.distiller(head, tail, fraction, tau)
        weights = mask.float() * (example.weight if weighted else 1.0)
        kl_sum, kl_n = distillation_kl(h_s, h_t, self.lm_head, mask, cfg.loss.kl_temperature, cfg.loss.kl_chunk,
                                       reduction="sum", weights=weights)
        kl = (self.global_mean(kl_sum, counts["kl"], cfg.train.grad_accum) if counts
              else self.global_mean(kl_sum, kl_n))
        # no capacity term: the top-B itself holds the budget; the record keeps the soft kept size
        cap_stats = {"soft_cache_entries": stats["soft_entries"], "budget_entries": stats["budget"],
                     "capacity_terms": 1}
        return StepLoss(kl, kl, torch.zeros((), device=dev), cap_stats, log_betas)

    def held_out_batch(self, rows: list, start: int) -> tuple[EvictionExample, float]:
        return rows[start], self.cfg.loss.evict_fractions[0]  # each held-out item at the first listed fraction

    def row_tokens(self, rows: list) -> float:
        return sum(len(e.head) + len(e.tail) for e in rows) / len(rows)

    def data_text(self, train_rows: list, eval_rows: list) -> str:
        return (f"objective evict: {len(train_rows)} train / {len(eval_rows)} held-out items, "
                f"budget {self.budget_text}")
