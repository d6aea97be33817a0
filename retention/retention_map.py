"""Retention maps: which KV-cache entries each layer and KV head keeps under a global budget over a prompt.

:func:`retention_map` runs the model once with the gates in score mode over a prompt, scores every entry as the
eviction policy does at the prompt's last token (:class:`~retention.policies.GlobalGatesPolicy` by default:
``(t - i + 1) * log beta_i``, the first ``sink`` tokens held) and keeps the global top-B with the cache's own
selection (:func:`retention.cache.select.select_keep`): what a :class:`~retention.cache.RetentionCache` of that
budget holds once the prompt is prefilled. :func:`plot_retention_map` draws it: a heatmap of layers x KV heads
(rows) by positions (columns), kept entries dark, image tokens marked above, and the kept fraction per layer.
``retention inspect --gates DIR --text FILE`` does both from the shell.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class RetentionMap:
    """``keep`` ``(L, H, T)`` bool: the entries kept; ``score`` ``(L, H, T)`` float32: the policy's scores (+inf
    for held sinks); ``log_beta`` ``(L, H, T)`` float32: the gates' scores; ``budget``: entries kept in all;
    ``image`` ``(T,)`` bool: image tokens (all False for text); ``tokens``: the prompt's tokens as text, if known."""

    keep: torch.Tensor
    score: torch.Tensor
    log_beta: torch.Tensor
    budget: int
    image: torch.Tensor
    tokens: list[str] | None = None

    def kept_fraction_per_layer(self) -> torch.Tensor:
        """``(L,)``: each layer's kept entries over its ``H * T``."""
        return self.keep.float().mean(dim=(1, 2))

    def kept_per_head(self) -> torch.Tensor:
        """``(L, H)`` int64: entries kept in each layer and KV head."""
        return self.keep.sum(-1)


def prompt_inputs(processor: Any, text: str, chat: bool = True) -> dict[str, torch.Tensor]:
    """``text`` as one user turn of the chat template (``chat``), else as plain text, tokenized for ``model(**x)``."""
    tok = getattr(processor, "tokenizer", processor)
    if chat and getattr(tok, "chat_template", None):
        return dict(processor.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  return_tensors="pt", return_dict=True))
    return dict(tok(text, return_tensors="pt"))


@torch.no_grad()
def retention_map(model: torch.nn.Module, inputs: dict[str, torch.Tensor], budget: int, policy: Any = None,
                  tokenizer: Any = None) -> RetentionMap:
    """The entries a global top-``budget`` keeps over one prompt (``inputs``: ``model(**inputs)`` keywords for a
    batch of one, e.g. from :func:`prompt_inputs` or a Qwen3-VL processor with images). The model must have gates
    attached (:func:`retention.attach_gates`); their mode is restored afterwards. ``policy``: a gate-scored policy
    (default ``GlobalGatesPolicy()``, the cache's default); ``tokenizer`` decodes the tokens for labels."""
    from .attach import text_config_of, unwrap
    from .cache.select import select_keep
    from .policies import GlobalGatesPolicy
    from .policies.base import EntryView

    attachment = getattr(unwrap(model), "retention", None)
    if attachment is None:
        raise ValueError("the model has no retention gates attached: attach_gates(model, gates, mode='score') first")
    policy = GlobalGatesPolicy() if policy is None else policy
    if not getattr(policy, "uses_gates", False) or getattr(policy, "needs_kv", False) or policy.needs_queries:
        raise ValueError(f"a retention map draws what gate scores keep: policy {policy.name!r} is not scored by the "
                         "gates alone (use GlobalGatesPolicy or TrimKVPolicy without value or key weights)")
    if policy.budget_scope != "global":
        raise ValueError(f"policy {policy.name!r} splits its budget by {policy.budget_scope}: the map draws one "
                         "global budget")
    ids = inputs["input_ids"]
    if ids.shape[0] != 1:
        raise ValueError(f"a retention map is drawn over one prompt, got a batch of {ids.shape[0]}")
    cfg = text_config_of(model)
    L, H, T = cfg.num_hidden_layers, cfg.num_key_value_heads, ids.shape[1]
    if not 1 <= budget:
        raise ValueError(f"budget must be >= 1 entries, got {budget}")
    device = next(model.parameters()).device
    with attachment.use_mode("score"):
        model(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}, use_cache=False)
        log_beta = torch.stack([lb[0].float().cpu() for lb in attachment.log_betas()])  # (L, H, T)
    policy.bind(model)
    policy.set_budget(budget, L, H)
    R = L * H
    pos = torch.arange(T).expand(R, T)
    image_id = getattr(getattr(unwrap(model), "config", None), "image_token_id", None)
    image = (ids[0] == image_id).cpu() if image_id is not None else torch.zeros(T, dtype=torch.bool)
    view = EntryView(log_beta=log_beta.reshape(R, T), pos=pos, valid=torch.ones(R, T, dtype=torch.bool),
                     step=torch.full((R,), T - 1), seq=torch.zeros(R, dtype=torch.long),
                     layer=torch.arange(L).repeat_interleave(H), head=torch.arange(H).repeat(L),
                     is_image=image.expand(R, T) if image_id is not None else None)
    score = policy.score(view)
    keep = select_keep(score, pos, view.valid, torch.zeros(R, dtype=torch.long), torch.tensor([budget]))
    tokens = tokenizer.convert_ids_to_tokens(ids[0].tolist()) if tokenizer is not None else None
    return RetentionMap(keep=keep.reshape(L, H, T), score=score.reshape(L, H, T), log_beta=log_beta, budget=budget,
                        image=image, tokens=tokens)


def plot_retention_map(rmap: RetentionMap, out: str | Path, title: str | None = None) -> Path:
    """Draw ``rmap`` into a PNG at ``out`` (written whole or not at all): the kept entries of every (layer, KV
    head) row over the prompt's positions, image tokens marked in a strip above, and the kept fraction per layer
    beside. Returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    L, H, T = rmap.keep.shape
    grid = rmap.keep.reshape(L * H, T).float().numpy()
    fig = plt.figure(figsize=(12, max(4.0, min(14.0, 1.5 + 0.09 * L * H))))
    widths, heights = [6, 1], [1, 30]
    gs = fig.add_gridspec(2, 2, width_ratios=widths, height_ratios=heights, hspace=0.03, wspace=0.04)
    strip, ax, bars = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[1, 0]), fig.add_subplot(gs[1, 1])
    fig.add_subplot(gs[0, 1]).axis("off")
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(["#f3f1ea", "#1f4e79"]),
              vmin=0, vmax=1, extent=(-0.5, T - 0.5, L * H - 0.5, -0.5))
    for layer in range(1, L):  # a thin line between layers
        ax.axhline(layer * H - 0.5, color="white", lw=0.4)
    step = max(1, L // 10)
    ax.set_yticks([layer * H + (H - 1) / 2 for layer in range(0, L, step)], [str(layer) for layer in range(0, L, step)])
    ax.set_ylabel(f"layer ({H} KV heads each)")
    ax.set_xlabel("position in the prompt")
    strip.imshow(rmap.image.float().numpy()[None], aspect="auto", interpolation="nearest",
                 cmap=ListedColormap(["#e8e8e8", "#d9822b"]), vmin=0, vmax=1, extent=(-0.5, T - 0.5, 0, 1))
    strip.set_xlim(ax.get_xlim())
    strip.set_xticks([])
    strip.set_yticks([0.5], ["image" if bool(rmap.image.any()) else "text"], fontsize=8)
    frac = rmap.kept_fraction_per_layer().numpy()
    bars.barh([layer * H + (H - 1) / 2 for layer in range(L)], frac, height=H * 0.8, color="#1f4e79")
    bars.set_ylim(ax.get_ylim())
    bars.set_yticks([])
    bars.axvline(rmap.budget / (L * H * T), color="#d9822b", lw=1, ls="--", label="budget share")
    bars.set_xlabel("kept per layer")
    bars.legend(loc="lower right", fontsize=7)
    kept = int(rmap.keep.sum())
    head = title or "retention map"
    shown = f", {int(rmap.image.sum())} image tokens (orange)" if bool(rmap.image.any()) else ""
    strip.set_title(f"{head}: {kept:,} of {L * H * T:,} entries kept ({kept / (L * H * T):.1%}), {T} tokens x "
                    f"{L} layers x {H} KV heads{shown}", fontsize=10)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        tmp.replace(out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def _inspect(args: argparse.Namespace) -> int:
    from .attach import attach_gates, check_gates_match
    from .cache import RetentionCache
    from .commands import check_gates_source, user_errors
    from .hub import load_gates
    from .models import load_model, shipped_gates

    def fail(message: str) -> int:
        print(f"retention inspect: error: {message}", file=sys.stderr)
        return 2

    text_file = Path(args.text)
    if not text_file.is_file():
        return fail(f"--text {args.text}: no such file; give a text file holding the prompt")
    text = text_file.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        return fail(f"--text {args.text} is empty")
    try:
        gates = check_gates_source(args.gates, args.model)
        model, processor = load_model(args.model)
        if gates is None and args.gates != "untrained":
            found = shipped_gates(model)
            if found is None:
                return fail(f"no gates shipped for {args.model}: pass --gates DIR (a checkpoint folder or Hub repo)")
            gates = load_gates(found, model=model)
        if gates is not None:
            check_gates_match(model, gates.config)
        attach_gates(model, gates, mode="score")
        inputs = prompt_inputs(processor, text, chat=not args.plain)
        T = inputs["input_ids"].shape[1]
        tokens = args.budget_tokens if args.budget_tokens is not None else max(1, round(0.1 * T))
        budget = RetentionCache.budget_for(model, tokens)
        rmap = retention_map(model, inputs, budget, tokenizer=getattr(processor, "tokenizer", processor))
    except user_errors() as e:
        return fail(str(e))
    title = f"{args.model}, gates {args.gates or 'shipped'}, {tokens} tokens per KV head"
    out = plot_retention_map(rmap, args.out, title=title)
    frac = rmap.kept_fraction_per_layer()
    print(f"{T} prompt tokens, budget {budget} entries ({tokens} per KV head on average): layers keep "
          f"{float(frac.min()):.1%} to {float(frac.max()):.1%} of their entries; map written to {out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("inspect", help="draw which KV entries each layer and head keeps under a budget (PNG)")
    p.add_argument("--gates", default=None, help="gate checkpoint folder or Hub repo (default: the model's shipped "
                   "gates; 'untrained' for none)")
    p.add_argument("--text", required=True, help="file holding the prompt")
    p.add_argument("--model", default="smollm2-135m", help="embedded name, Hub id or local folder")
    p.add_argument("--budget-tokens", type=int, default=None,
                   help="budget in tokens per KV head on average (default: 10%% of the prompt)")
    p.add_argument("--out", default="retention-map.png", help="PNG to write (default: retention-map.png)")
    p.add_argument("--plain", action="store_true", help="the text as it is, not as a user turn of the chat template")
    p.set_defaults(func=_inspect)
