"""Retention gates: one small scorer per (layer, KV head), read out on one global scale.

For layer ``l``, KV head ``h`` and token ``i`` with attention input ``x_i`` (the hidden state after the
layer's input norm) a gate predicts

    z = w . phi_{l,h}(x_i) + b,        log_beta = logsigmoid(z)  (<= 0)

``phi_{l,h}`` is a small head-specific MLP and the readout ``(w, b)`` is one tensor shared by every layer
and head: that tie puts all retention scores on one scale, so eviction can rank entries globally.

Ablation variants (``GateConfig.variant``):

``global``  per-head MLP ``phi_{l,h}``; one readout row shared by all layers and heads (ours).
``seed``    the seed authors' released variant: an MLP per layer shared by its heads, then a readout
            tied across layers with one row per KV head.
``trimkv``  nothing tied (TRIM-KV): an MLP per layer, a readout row per (layer, head).
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .architecture import architecture_fingerprint, text_config_of, unwrap
from .card import model_card
from .io import atomic_directory, save_state
from .locate import checkpoint_folder, is_gate_folder
from .metadata import META_FILE, metadata_file, write_metadata
from .upload import check_push_target, push_to_hub

VARIANTS = ("global", "seed", "trimkv")
CHECKPOINT_FORMAT = "retention-gates/1"  # the metadata's "format": one layout, written by save_pretrained alone
UNTRAINED_SEED = 0  # the initial weights of untrained gates at inference (demo, chat, eval): one set everywhere
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh}


class GateCheckpointError(ValueError):
    """A folder named as a gate checkpoint cannot be read as one (a file missing, damaged, or of another layout); the
    message says which and the fix."""


@dataclass
class GateConfig:
    """Shape and options of a set of retention gates.

    ``num_layers``, ``num_kv_heads`` and ``hidden_size`` describe the base model and are filled in by
    :meth:`for_model`, as are ``base_model`` (its name), ``base_model_type`` (its top-level ``model_type``) and
    ``base_architecture`` (:func:`retention.architecture.architecture_fingerprint` of its config, which attaching
    compares); ``gate_hidden`` is the width of each gate MLP.
    """

    num_layers: int
    num_kv_heads: int
    hidden_size: int
    variant: str = "global"
    gate_hidden: int = 64
    activation: str = "silu"
    # logsigmoid(18) = -1.5e-8: beta starts at 1 to fp32 precision, so the student starts as the teacher.
    bias_init: float = 18.0
    base_model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # None in checkpoints written before they were recorded: attaching then compares the base model's name
    base_model_type: str | None = None
    base_architecture: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "hidden_size", "gate_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GateConfig.{name} must be a positive integer, got {value!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"GateConfig.variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"GateConfig.activation must be one of {tuple(ACTIVATIONS)}, got {self.activation!r}"
            )
        if (not isinstance(self.bias_init, numbers.Real) or isinstance(self.bias_init, bool)
                or not math.isfinite(float(self.bias_init))):
            raise ValueError(f"GateConfig.bias_init must be a finite number, got {self.bias_init!r}")

    @classmethod
    def for_model(cls, model: nn.Module, **options: Any) -> "GateConfig":
        """Read the layer count, KV heads and hidden size off a (supported) HF model."""
        cfg = text_config_of(model)
        name = getattr(getattr(model, "config", cfg), "_name_or_path", None) or None
        options.setdefault("base_model", name)
        for key, value in base_architecture_of(model).items():
            options.setdefault(key, value)
        taken = {f.name for f in fields(cls)} - {"num_layers", "num_kv_heads", "hidden_size"}
        if set(options) - taken:
            raise TypeError(f"unknown gate option(s) {sorted(set(options) - taken)}; the options are {sorted(taken)} "
                            "(the layer count, KV heads and hidden size come from the model)")
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            hidden_size=cfg.hidden_size,
            **options,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GateConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GateConfig keys {unknown}; allowed: {sorted(known)}")
        return cls(**data)


def base_architecture_of(model: nn.Module) -> dict[str, str | None]:
    """What :class:`GateConfig` records of the architecture of ``model`` (a supported HF model, wrapped or not):
    ``base_model_type`` (its top-level ``model_type``: ``qwen3_vl`` for the vision-language model, not its decoder's)
    and ``base_architecture`` (:func:`retention.architecture.architecture_fingerprint` of its config)."""
    top = getattr(unwrap(model), "config", None) or text_config_of(model)
    return {"base_model_type": getattr(top, "model_type", None), "base_architecture": architecture_fingerprint(top)}


class RetentionGates(nn.Module):
    """All retention gates of one model.

    Parameters are stacked over layers (and heads) so a layer's heads are scored in one batched op.

    ``W1``: ``(L, E, D, r)`` with ``E = num_kv_heads`` (per-head MLP) or ``1`` (per-layer MLP);
    ``b1``: ``(L, E, r)``; readout ``w``: ``(R, r)`` and ``b``: ``(R,)`` with ``R`` = 1 (global),
    ``H`` (seed) or ``L * H`` (trimkv).

    ``seed``: draw the initial weights from a generator of this seed (``None``: torch's global RNG, which a
    training run seeds). Untrained gates used for inference take :data:`UNTRAINED_SEED`: their betas differ from 1
    by a little noise, and without a seed each process would draw another ranking (another reply, another
    fingerprint, so a resumed sweep would score its gated rows again).
    """

    def __init__(self, config: GateConfig, seed: int | None = None) -> None:
        super().__init__()
        self.config = config
        L, H, D, r = config.num_layers, config.num_kv_heads, config.hidden_size, config.gate_hidden
        E = H if config.variant == "global" else 1
        R = {"global": 1, "seed": H, "trimkv": L * H}[config.variant]
        self.W1 = nn.Parameter(torch.empty(L, E, D, r))
        self.b1 = nn.Parameter(torch.zeros(L, E, r))
        self.w = nn.Parameter(torch.empty(R, r))
        self.b = nn.Parameter(torch.empty(R))
        self._act = ACTIVATIONS[config.activation]
        self.reset_parameters(None if seed is None else torch.Generator().manual_seed(seed))

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        D, r = self.config.hidden_size, self.config.gate_hidden
        with torch.no_grad():
            nn.init.normal_(self.W1, std=D**-0.5, generator=generator)
            self.b1.zero_()
            nn.init.normal_(self.w, std=r**-0.5, generator=generator)
            self.b.fill_(self.config.bias_init)

    def readout(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Readout rows used by ``layer``: ``w`` ``(H, r)`` and ``b`` ``(H,)``."""
        H = self.config.num_kv_heads
        if self.config.variant == "global":
            return self.w.expand(H, -1), self.b.expand(H)
        if self.config.variant == "seed":
            return self.w, self.b
        return self.w[layer * H : (layer + 1) * H], self.b[layer * H : (layer + 1) * H]

    def logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid scores ``z``: ``x`` ``(B, T, D)`` -> ``(B, H, T)`` float32."""
        # in the weights' dtype: float32 gates score in float32 whatever the model's dtype, and DeepSpeed's bf16
        # engine, which casts the trained module (gates too) to bf16 beside its fp32 master copy, scores in bf16
        x = x.to(self.W1.dtype)
        phi = torch.einsum("btd,edr->betr", x, self.W1[layer]) + self.b1[layer][None, :, None, :]
        phi = self._act(phi)  # (B, E, T, r)
        w, b = self.readout(layer)
        # per-head MLP: head h reads its own embedding; per-layer MLP: every head reads the shared one
        eq = "bhtr,hr->bht" if phi.shape[1] > 1 else "betr,hr->bht"
        return (torch.einsum(eq, phi, w) + b[None, :, None]).float()

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``log_beta`` for one layer: ``x`` ``(B, T, D)`` -> ``(B, num_kv_heads, T)`` float32, <= 0."""
        if x.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"gate input has hidden size {x.shape[-1]}, gates were built for {self.config.hidden_size}"
            )
        return F.logsigmoid(self.logits(layer, x))

    def widened(self, gate_hidden: int, generator: torch.Generator | None = None) -> "RetentionGates":
        """A copy whose MLPs are ``gate_hidden`` wide, scoring every token exactly as these gates do.

        The new hidden units get fresh input weights (as :meth:`reset_parameters` draws them) and readout
        weights of 0, so they add nothing until training moves their readout; training then starts from
        this checkpoint's scores with more capacity. ``generator`` seeds the new input weights.
        """
        r = self.config.gate_hidden
        if not isinstance(gate_hidden, int) or gate_hidden < r:
            raise ValueError(f"cannot widen gates of width {r} to {gate_hidden!r}: give a width >= {r}")
        wide = RetentionGates(GateConfig.from_dict({**self.config.to_dict(), "gate_hidden": gate_hidden}))
        with torch.no_grad():
            W1 = torch.empty(*self.W1.shape[:-1], gate_hidden - r, dtype=self.W1.dtype)
            W1.normal_(std=self.config.hidden_size**-0.5, generator=generator)
            wide.W1.copy_(torch.cat([self.W1.detach().cpu(), W1], dim=-1))
            wide.b1.zero_()[..., :r] = self.b1.detach().cpu()
            wide.w.zero_()[:, :r] = self.w.detach().cpu()
            wide.b.copy_(self.b.detach().cpu())
        return wide.to(self.W1.device)

    def fingerprint(self) -> str:
        """12 hex digits of a SHA-256 over every parameter (name, dtype, shape, bytes): which gates scored a
        result, so results of other gates are never mixed in (see ``retention.eval.runner``)."""
        from .io import tensors_sha256

        return tensors_sha256(self.state_dict())[:12]

    # -- persistence -------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path, metadata: dict[str, Any] | None = None, **info: Any) -> Path:
        """Write the gate checkpoint: ``gates.safetensors``, ``retention.json`` (:mod:`retention.metadata`, with the
        tensors' SHA-256) and ``README.md`` (the model card, :func:`retention.card.model_card`) into ``path``
        atomically (temp dir + rename); ``path`` must be new, empty or gates written before
        (:func:`check_gate_folder_target`). Returns ``path`` (``~`` expanded).

        ``info`` (or ``metadata``, a dict of the same keys): what the metadata records beside the gate config:
        ``base_model`` (the base model's Hub id; it replaces the gate config's, which may name a local folder),
        ``base_revision``, ``budget``, ``training`` (the card's training record), ``datasets`` (Hub dataset ids)...
        :func:`retention.hub.export_gates` is this method."""
        path = Path(path).expanduser()  # as from_pretrained reads "~/gates"
        info = {**(metadata or {}), **info}
        gate_config = self.config.to_dict()
        if info.get("base_model"):  # one name for the base: the gates' own may be a local folder they were trained from
            gate_config["base_model"] = info["base_model"]
        meta = {"gate_config": gate_config, "format": CHECKPOINT_FORMAT, **info}
        check_finite_before_writing(self, path)  # what loading refuses must not replace what is there
        check_gate_folder_target(path)  # the folder is replaced whole: never over someone's files
        with atomic_directory(path) as tmp:
            meta[GATES_SHA256] = save_state(self.state_dict(), tmp / "gates.safetensors", metadata={"format": "pt"})
            write_metadata(tmp, meta)  # results tables, if given, go to the card only
            (tmp / "README.md").write_text(model_card(meta))
        return path

    def push_to_hub(self, repo_id: str, private: bool = False, token: str | None = None,
                    commit_message: str = "Upload retention gates", **info: Any) -> str:
        """Upload these gates to the Hub repo ``repo_id`` (created if needed) as the checkpoint :meth:`save_pretrained`
        writes (``info``: its metadata, ``base_model`` a Hub id above all), through
        :func:`retention.upload.push_to_hub`; returns the commit URL. ``token``: else ``HF_TOKEN`` or a stored
        login. HubError naming the fix before anything is sent: a bad repo id, no token, no Hub id for the base."""
        import tempfile

        check_push_target(repo_id, token)  # before anything is written
        with tempfile.TemporaryDirectory(prefix="retention-push-") as tmp:
            folder = self.save_pretrained(Path(tmp) / "gates", **info)
            return push_to_hub(folder, repo_id, private=private, token=token, commit_message=commit_message)

    @classmethod
    def from_pretrained(cls, path: str | Path, revision: str | None = None, verify: bool = True,
                        token: str | None = None) -> "RetentionGates":
        """Load gates written by :meth:`save_pretrained` (safetensors only): a folder, else a shipped checkpoint's
        name (``smollm2-135m-global``) or a Hub repo id (``owner/name``, at ``revision``; ``token`` for a private
        repo), downloaded by ``huggingface_hub.snapshot_download`` as :func:`retention.hub.load_gates` finds them
        (which also checks them against a model).

        ``verify``: check the tensors against the SHA-256 the metadata records (:data:`GATES_SHA256`; checkpoints
        written before it have none and load as they are); ``False`` loads gates whose weights were edited on
        purpose."""
        from safetensors.torch import load_file

        if not Path(path).expanduser().is_dir():
            path = checkpoint_folder(path, revision, token)  # HubError naming the fix when it is none of these
        path = Path(path).expanduser()
        cfg_file, weights = metadata_file(path), path / "gates.safetensors"
        for f in (cfg_file, weights):
            if not f.is_file():
                inside = gate_folders_under(path)
                hint = f"; the gate checkpoints under it: {', '.join(inside)}" if inside else ""
                if (path / "state.json").is_file() and weights.is_file():  # a run's checkpoints/step-N
                    hint = ("; it is a training checkpoint: export its gates with `python train.py --config CONFIG "
                            f"--export {path}` and load the exported folder")
                raise GateCheckpointError(f"{f} not found: a gate checkpoint needs {META_FILE} (config.json before "
                                          f"it) and gates.safetensors{hint}")
        from safetensors import SafetensorError

        try:
            meta = json.loads(cfg_file.read_text())
            with torch.random.fork_rng(devices=[]):  # the initial weights are overwritten: leave the caller's draws be
                gates = cls(GateConfig.from_dict(meta["gate_config"]))
        except (ValueError, KeyError, TypeError) as e:  # not JSON, no gate_config, or a bad value in it
            raise GateCheckpointError(f"{cfg_file} is not a gate config ({type(e).__name__}: {e}); re-export or "
                                      "re-download the checkpoint") from None
        try:
            state = load_file(str(weights))
            if verify:
                check_gates_sha256(state, meta.get(GATES_SHA256), weights, cfg_file)
            gates.load_state_dict(state)
        except (SafetensorError, RuntimeError) as e:  # a cut-off download; tensors of another layout than the config's
            raise GateCheckpointError(f"{weights} cannot be loaded into the gates {cfg_file.name} describes ({e}); "
                                      "re-export or re-download the checkpoint") from None
        if bad := nonfinite_tensors(gates.state_dict()):  # NaN scores would evict at random, without a word
            raise GateCheckpointError(
                f"gate checkpoint {path}: its weights hold NaN or inf ({', '.join(bad)}), so the training run that "
                "wrote it most likely diverged; train again with a lower train.lr, or export an earlier checkpoint "
                "of that run (python train.py --config CONFIG --export RUN/checkpoints/step-N, one from before the "
                "loss went NaN)")
        return gates


GATES_SHA256 = "gates_sha256"  # the metadata key: retention.io.tensors_sha256 of gates.safetensors's tensors


def check_gates_sha256(state: Mapping[str, torch.Tensor], recorded: Any, weights: Path, meta_file: Path) -> None:
    """GateCheckpointError naming ``weights`` when its tensors (``state``, as loaded) do not hash to ``recorded``
    (the SHA-256 its metadata holds): flipped bytes inside a tensor load without any other error. Nothing to check
    when ``recorded`` is None (a checkpoint from before the hash was recorded)."""
    if recorded is None:
        return
    from .io import tensors_sha256

    found = tensors_sha256(state)
    if found != recorded:
        raise GateCheckpointError(
            f"{weights} is damaged: its tensors do not match the SHA-256 that {meta_file.name} records "
            f"({str(recorded)[:12]}..., found {found[:12]}...); re-export or re-download the checkpoint. If you "
            f"changed the weights on purpose, load them with verify=False (RetentionGates.from_pretrained or "
            f"load_gates), or remove {GATES_SHA256} from {meta_file}")


def nonfinite_tensors(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The tensors of ``state`` that hold NaN or inf, each as ``name (k of n values)``; empty when all are finite."""
    return [f"{name} ({bad} of {t.numel()} values)" for name, t in state.items()
            if (bad := int((~torch.isfinite(t)).sum()))]


def check_finite_before_writing(gates: RetentionGates, path: str | Path) -> None:
    """ValueError before gates holding NaN or inf are written to ``path``: loading refuses them, so the write would
    only replace what is there (earlier, good gates) with a checkpoint nothing can read."""
    if bad := nonfinite_tensors(gates.state_dict()):
        raise ValueError(f"the gates to write to {path} hold NaN or inf ({', '.join(bad)}): nothing written; a "
                         "training run that diverged should export a checkpoint from before the loss went NaN")


def gate_folders_under(path: str | Path, depth: int = 2) -> list[str]:
    """The gate checkpoints inside ``path`` (a training run's folder: its ``final``; its ``checkpoints/step-N`` hold
    trainer state, not a loadable checkpoint), as paths relative to it, at most ``depth`` levels down; none when
    ``path`` is no folder."""
    root = Path(path)
    if not root.is_dir():
        return []
    found, level = [], [root]
    for _ in range(depth):
        below = []
        for folder in level:
            try:
                below += sorted(d for d in folder.iterdir() if d.is_dir())
            except OSError:  # unreadable: nothing to suggest from it
                continue
        level = below
        found += [d.relative_to(root).as_posix() for d in level if is_gate_folder(d)]
    return found


def check_gate_folder_target(path: str | Path) -> None:
    """FileExistsError unless gates may be written to ``path``: absent, empty, or earlier gates (replaced whole)."""
    from .io import check_replaceable

    check_replaceable(path, is_gate_folder, "a gate checkpoint")
