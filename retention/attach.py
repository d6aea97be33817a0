"""Attach retention gates to a frozen Hugging Face model through transformers' extension points.

No modeling file is copied. Two public hooks carry the method:

* a forward pre-hook on every decoder ``self_attn`` module computes ``log_beta`` ``(B, H_kv, T)`` from
  the attention input (the hidden state after the layer's input norm), only in student mode;
* an attention function registered in transformers' ``AttentionInterface`` (and its mask function in
  ``AttentionMaskInterface``) runs either the model's own attention (teacher: gates bypassed, output
  identical to the unpatched model) or retention-gated attention (student);
* ``"score"`` mode (inference): the pre-hook computes ``log_beta`` of the new tokens and hands it to a
  retention cache (:class:`retention.cache.RetentionCache`), whose kept entries the attention function
  then attends over with standard attention.
* ``"bias"`` mode (eviction-aware training, :mod:`retention.train.evict`): new tokens attend over a cache of past
  keys with an additive per-(KV head, key) bias on the past keys (``log`` of a soft keep weight) and
  causally among themselves; the gates are not run.

One copy of the base weights serves both modes; only gate parameters require grad.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

# model config access lives in architecture (the gates need it too); these names stay importable from here
from .architecture import (SUPPORTED_MODEL_TYPES, UnsupportedModelError, architecture_fingerprint,  # noqa: F401
                           check_supported, sliding_window_of, text_config, text_config_of, unwrap)
from .gates import GateConfig, RetentionGates
from .locate import looks_like_a_path
from .ops.retention_attention import retention_attention
from .padding import new_token_valid

MODES = ("teacher", "student", "score", "bias")


class GatesMismatchError(ValueError):
    """Gates built for a base model of other shapes (layers, KV heads, hidden size) than the one given."""


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder's self-attention modules, ordered by ``layer_idx``."""
    text_cfg = text_config_of(model)
    found = {}
    for name, module in unwrap(model).named_modules():
        if name.endswith("self_attn") and getattr(module, "config", None) is text_cfg and hasattr(module, "layer_idx"):
            found[module.layer_idx] = module
    if sorted(found) != list(range(text_cfg.num_hidden_layers)):
        raise UnsupportedModelError(
            f"found attention modules for layers {sorted(found)} but the config has "
            f"{text_cfg.num_hidden_layers} layers; is this a supported decoder?"
        )
    return [found[i] for i in range(text_cfg.num_hidden_layers)]


@dataclass
class _LayerState:
    """What the attention function of one layer needs; kept off the module's parameter tree."""

    layer: int
    attachment: "RetentionAttachment"
    base_fn: Callable
    log_beta: torch.Tensor | None = None  # (B, H_kv, T) of the current forward
    history: torch.Tensor | None = None  # (B, H_kv, T_past + T) when decoding with a cache
    cache: Any = None  # score mode: the retention cache of the current forward (retention.cache)
    key_bias: torch.Tensor | None = None  # bias mode: (B, H_kv, T_past) added to the logits of past keys


# the boundaries found in the last position_ids: every layer of a forward gets the same tensor, and finding them
# waits for the GPU once (a sync per layer kept a training step's launches from running ahead of the GPU)
_LAST_RESTARTS: list = [None, None]  # [weakref to position_ids and its (pointer, version), cu_seqlens or None]


def _cu_seqlens(kwargs: dict[str, Any], batch: int, seqlen: int) -> torch.Tensor | None:
    """Document boundaries over the flattened batch: explicit ``cu_seq_lens_k`` or restarts of position_ids."""
    cu = kwargs.get("cu_seq_lens_k", kwargs.get("cu_seq_lens_q"))
    if cu is not None:
        return cu
    pos = kwargs.get("position_ids")
    if pos is None or pos.ndim != 2 or pos.shape != (batch, seqlen):
        return None
    seen = _LAST_RESTARTS[0]
    if seen is not None and seen[0]() is pos and seen[1] == (pos.data_ptr(), pos._version):
        return _LAST_RESTARTS[1]
    cu = _restarts(pos, batch, seqlen)
    _LAST_RESTARTS[:] = [(weakref.ref(pos), (pos.data_ptr(), pos._version)), cu]
    return cu


def _restarts(pos: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor | None:
    """``cu_seqlens`` where ``pos`` ``(batch, seqlen)`` restarts (a packed row's documents); None if it never does."""
    restart = torch.ones_like(pos, dtype=torch.bool)
    restart[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(restart[:, 1:].any()):
        return None
    starts = restart.flatten().nonzero().flatten()
    end = torch.tensor([batch * seqlen], device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)


def sink_mask(batch: int, seqlen: int, cu_seqlens: torch.Tensor | None, sink: int,
              device: torch.device) -> torch.Tensor:
    """``(batch, seqlen)`` bool: the first ``sink`` tokens of every sequence (each packed document)."""
    if cu_seqlens is None:
        return (torch.arange(seqlen, device=device) < sink).expand(batch, seqlen)
    flat = torch.arange(batch * seqlen, device=device)
    starts = cu_seqlens.to(device=device, dtype=torch.long)
    doc = torch.searchsorted(starts, flat, right=True) - 1
    return ((flat - starts[doc]) < sink).view(batch, seqlen)


def key_bias_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                       scale: float | None = None) -> torch.Tensor:
    """New queries over past + new keys, with ``bias`` added to the logits of the past keys.

    ``query`` ``(B, Hq, Tq, D)``; ``key/value`` ``(B, H, P + Tq, D)`` (the last ``Tq`` are the new tokens,
    seen causally); ``bias`` ``(B, H, P)`` float (``-inf``: evicted; ``None``: no bias). A KV head's bias
    applies to its ``Hq / H`` query heads. Returns ``(B, Tq, Hq, D)`` (transformers' output layout).
    """
    B, Hq, Tq, D = query.shape
    H, Tk = key.shape[1], key.shape[2]
    G, P = Hq // H, Tk - Tq
    scale = D**-0.5 if scale is None else scale
    q = query.reshape(B, H, G * Tq, D).float()
    logits = torch.einsum("bhqd,bhkd->bhqk", q, key.float()) * scale  # (B, H, G*Tq, Tk)
    # query g * Tq + j (head g of the group, token j) sees every past key and new keys 0..j
    causal = torch.cat([torch.zeros(Tq, P, device=query.device),
                        torch.full((Tq, Tq), float("-inf"), device=query.device).triu(1)], dim=1)
    logits = logits + causal.repeat(G, 1)
    if bias is not None:
        if bias.shape != (B, H, P):
            raise ValueError(f"key bias has shape {tuple(bias.shape)}, the cache holds (B, H, P) = {(B, H, P)} "
                             "past keys")
        logits = torch.cat([logits[..., :P] + bias[:, :, None, :].float(), logits[..., P:]], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhqk,bhkd->bhqd", probs, value.float())
    return out.reshape(B, Hq, Tq, D).transpose(1, 2).to(query.dtype)


def retention_attention_function(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` ``(B, Hq, Tq, D)``, ``key/value`` ``(B, Hkv, Tk, D)``.

    Teacher mode calls the model's own attention. Student mode runs retention-gated attention on an
    unpadded batch (plain or packed with ``position_ids`` restarts / ``cu_seq_lens_k``); padding masks
    are not supported there (pack instead).
    """
    state: _LayerState = module._retention_state
    if state.attachment.mode == "teacher":
        return state.base_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if state.attachment.mode == "score":
        # inference: standard attention over the kept entries of a retention cache (the model's own
        # attention when the cache is an ordinary one)
        cache, state.cache = state.cache, None
        if cache is None:
            return state.base_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        return cache.retention_attend(state.layer, query, scaling), None
    if state.attachment.mode == "bias":
        return key_bias_attention(query, key, value, state.key_bias, scaling), None
    # once per forward (a device sync); flex_attention's mask is a BlockMask, which new_token_valid reads too
    if state.layer == 0 and attention_mask is not None:
        valid = new_token_valid(attention_mask, key.shape[0], key.shape[2])
        if valid is not None and not bool(valid.all()):
            raise ValueError(
                "student mode does not support padded batches (the gated attention would attend to the padding): "
                "run sequences one at a time or packed (position_ids restarting per document); for generation "
                "with eviction use score mode and a RetentionCache, which handles padding"
            )
    log_beta = state.log_beta
    Tq, Tk = query.shape[2], key.shape[2]
    sink = state.attachment.sink
    if sink and Tq != Tk and Tk - Tq < sink:
        # cached decoding while the sequence is still within its first `sink` tokens (a prompt shorter than the
        # sink): those keep log_beta = 0 here too, as a forward over the whole sequence gives them
        state.log_beta = log_beta = log_beta.masked_fill(torch.arange(Tk - Tq, Tk, device=log_beta.device) < sink, 0.0)
    if Tk == Tq:
        state.history = log_beta
    else:  # decoding with a cache: past log_beta were kept by earlier calls
        past = state.history
        state.history = log_beta if past is None else torch.cat([past, log_beta], dim=-1)
        if state.history.shape[-1] != Tk:
            raise RuntimeError(
                f"student-mode cache holds {Tk} keys but {state.history.shape[-1]} gate scores; "
                "start generation from an empty cache after switching to student mode"
            )
    cu = _cu_seqlens(kwargs, query.shape[0], Tq) if Tq == Tk else None
    if sink and Tq == Tk:
        # the inference policy always keeps each sequence's first tokens: never decay them here either,
        # so the gates learn the rest with the sink in place (the losses read the masked scores)
        state.log_beta = state.history = log_beta.masked_fill(
            sink_mask(query.shape[0], Tq, cu, sink, log_beta.device)[:, None], 0.0)
    out = retention_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        state.history,
        scale=scaling,
        cu_seqlens=cu,
    )
    return out, None


def _register(base: str) -> str:
    """Register ``retention_<base>`` with transformers (attention and mask functions); return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"retention_{base}"
    if base not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise UnsupportedModelError(f"attention implementation {base!r} cannot be wrapped; use 'sdpa' or 'eager'")
    AttentionInterface.register(name, retention_attention_function)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[base])
    return name


def _base_function(module: nn.Module, base: str) -> Callable:
    from transformers import AttentionInterface

    if base == "eager":  # eager lives in the modeling file, not in the registry
        return sys.modules[type(module).__module__].eager_attention_forward
    return AttentionInterface._global_mapping[base]


@dataclass
class RetentionAttachment:
    """Handle returned by :func:`attach_gates`: switch modes, read the last gate scores, detach."""

    model: nn.Module
    gates: RetentionGates
    modules: list[nn.Module]
    base_impl: str
    mode: str = "student"
    # student mode: each sequence's first ``sink`` tokens keep log_beta = 0 (train as the inference
    # policy's attention sinks are kept); 0 leaves every token to the gates
    sink: int = 0
    _hooks: list[Any] = field(default_factory=list)
    _unfrozen: list[nn.Parameter] = field(default_factory=list)  # base parameters attaching froze: detach thaws them
    detached: bool = False

    def _check_attached(self) -> None:
        if self.detached:  # the hooks are gone: a student() forward would silently run the plain model
            raise RuntimeError("these gates were detached from the model (detach()): attach them again with "
                               "attach_gates(model, attachment.gates)")

    def set_mode(self, mode: str) -> None:
        self._check_attached()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    @contextlib.contextmanager
    def use_mode(self, mode: str) -> Iterator["RetentionAttachment"]:
        self._check_attached()
        previous = self.mode
        self.set_mode(mode)
        try:
            yield self
        finally:
            self.mode = previous

    def teacher(self) -> contextlib.AbstractContextManager:
        """Context: gates bypassed; the model computes exactly what it computed before attaching."""
        return self.use_mode("teacher")

    def student(self) -> contextlib.AbstractContextManager:
        """Context: retention-gated attention."""
        return self.use_mode("student")

    def log_betas(self) -> list[torch.Tensor]:
        """Per layer ``(B, H_kv, T)`` float32 from the last student forward."""
        self._check_attached()
        out = [m._retention_state.log_beta for m in self.modules]
        if any(x is None for x in out):
            raise RuntimeError("no gate scores yet: run a forward pass in student mode first")
        return out

    @contextlib.contextmanager
    def use_gates(self, gates: RetentionGates) -> Iterator["RetentionAttachment"]:
        """Context: score with other gates for the same model (e.g. comparing two checkpoints)."""
        self._check_attached()
        check_gates_match(self.model, gates.config)
        previous = self.gates  # stays the registered submodule: the swap only changes who scores
        gates.to(device=next(previous.parameters()).device)
        self.gates = gates
        try:
            yield self
        finally:
            self.gates = previous

    @contextlib.contextmanager
    def key_biases(self, biases: list[torch.Tensor]) -> Iterator["RetentionAttachment"]:
        """Context in bias mode: layer ``l``'s attention adds ``biases[l]`` ``(B, H_kv, T_past)`` to its logits of
        the past (cached) keys; cleared on exit."""
        for m, b in zip(self.modules, biases):
            m._retention_state.key_bias = b
        try:
            with self.use_mode("bias"):
                yield self
        finally:
            for m in self.modules:
                m._retention_state.key_bias = None

    def reset(self) -> None:
        """Forget gate scores kept for decoding with a cache."""
        self._check_attached()
        for m in self.modules:
            m._retention_state.log_beta = None
            m._retention_state.history = None
            m._retention_state.cache = None
            m._retention_state.key_bias = None

    def detach(self) -> nn.Module:
        """Remove hooks, gates and the attention override, and let the parameters attaching froze require grad
        again; return the plain model. Detaching twice does nothing more; any other use afterwards raises."""
        if self.detached:
            return self.model
        self.detached = True
        for p in self._unfrozen:
            p.requires_grad_(True)
        for h in self._hooks:
            h.remove()
        for m in self.modules:
            del m._retention_state
            m.config._attn_implementation_internal = self.base_impl
        base = unwrap(self.model)
        if getattr(base, "retention_gates", None) is self.gates:
            del base.retention_gates
        if getattr(base, "retention", None) is self:
            del base.retention
        return self.model


def attach_gates(
    model: nn.Module,
    gates: RetentionGates | GateConfig | None = None,
    *,
    freeze_base: bool = True,
    mode: str = "student",
    seed: int | None = None,
    **gate_options: Any,
) -> RetentionAttachment:
    """Attach retention gates to ``model`` (Llama, Mistral, Qwen2/2.5, Qwen3, Qwen3-VL; no sliding-window layers)
    in place.

    ``gates`` may be built gates, a :class:`GateConfig`, or ``None`` (built from the model with
    ``gate_options``, e.g. ``variant="trimkv"``); ``seed`` draws new gates' initial weights from a generator of
    its own (``None``: torch's global RNG). The gates become the submodule ``retention_gates`` of
    the transformers model so optimizers, DDP and DeepSpeed see them; with ``freeze_base`` every other
    parameter stops requiring grad. Returns the handle, also stored as ``model.retention``.
    """
    base = unwrap(model)
    modules = attention_modules(model)  # validates the architecture first
    if mode not in MODES:  # before the model is touched (frozen, a submodule added)
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if getattr(base, "retention", None) is not None:
        raise RuntimeError("this model already has retention gates attached; call model.retention.detach() first")
    if any(hasattr(m, "_retention_state") for m in modules):
        # attached through a model around or inside this one (the causal LM and its decoder share these layers): a
        # second hook would score every layer twice, and either detach would break the other's forward
        owner = next(m for m in modules if hasattr(m, "_retention_state"))._retention_state.attachment.model
        raise RuntimeError(f"this model's layers already have retention gates attached (through the "
                           f"{type(owner).__name__} holding them); call its .retention.detach() first")
    if gates is None or isinstance(gates, GateConfig):
        config = gates if isinstance(gates, GateConfig) else GateConfig.for_model(model, **gate_options)
        gates = RetentionGates(config, seed=seed)
    elif gate_options or seed is not None:
        raise ValueError("gate options and seed are only used when building new gates; got built gates too")
    check_gates_match(model, gates.config)

    param = next(base.parameters())
    gates.to(device=param.device)
    unfrozen = [p for p in base.parameters() if p.requires_grad] if freeze_base else []
    for p in unfrozen:
        p.requires_grad_(False)
    base.retention_gates = gates
    for p in gates.parameters():
        p.requires_grad_(True)

    base_impl = modules[0].config._attn_implementation or "eager"
    name = _register(base_impl)
    attachment = RetentionAttachment(model=model, gates=gates, modules=modules, base_impl=base_impl,
                                     _unfrozen=unfrozen)
    attachment.set_mode(mode)
    for m in modules:
        m._retention_state = _LayerState(layer=m.layer_idx, attachment=attachment, base_fn=_base_function(m, base_impl))
        attachment._hooks.append(m.register_forward_pre_hook(_gate_hook, with_kwargs=True))
    modules[0].config._attn_implementation_internal = name
    object.__setattr__(base, "retention", attachment)
    return attachment


def _gate_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    state: _LayerState = module._retention_state
    mode = state.attachment.mode
    if mode in ("teacher", "bias"):
        return
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    if mode != "score":
        state.log_beta = state.attachment.gates(state.layer, x)
        return
    # a retention cache (anything with this method) takes each new token's log_beta with its K/V
    # transformers >= 5.24 passes the cache as `cache` (`past_key_values` before)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    state.cache = cache if hasattr(cache, "retention_pre_attention") else None
    if gates_needed(state.cache):
        state.log_beta = state.attachment.gates(state.layer, x)
    else:  # a training-free policy ranks without beta: the store keeps log_beta 0 (beta 1) for its entries
        B, T = x.shape[0], x.shape[1]
        state.log_beta = torch.zeros(B, state.attachment.gates.config.num_kv_heads, T, dtype=torch.float32,
                                     device=x.device)
    if state.cache is not None:
        state.cache.retention_pre_attention(state.layer, state.log_beta, kwargs.get("attention_mask"))


def gates_needed(cache: Any) -> bool:
    """Whether the gate MLP must score a score-mode forward into ``cache``: not for a retention cache whose policy is
    training-free (``uses_gates`` False, e.g. SnapKV, H2O, StreamingLLM), which never reads the scores, unless that
    policy asks for them (``keeps_gate_scores``: a cache another, gated policy ranks later)."""
    policy = getattr(cache, "policy", None)
    if policy is None:
        return True
    return bool(getattr(policy, "uses_gates", True) or getattr(policy, "keeps_gate_scores", False))


def model_stem(name: str | None) -> str:
    """A model's name without its owner or folder (``HuggingFaceTB/SmolLM2-135M-Instruct`` and a local
    ``/models/SmolLM2-135M-Instruct`` are the same model), lower case; ``""`` when unknown."""
    return str(name or "").rstrip("/").rsplit("/", 1)[-1].lower()


def check_gates_shape(text_cfg: Any, config: GateConfig) -> None:
    """:class:`GatesMismatchError` when gates were built for a text decoder of other shapes than ``text_cfg``'s (a
    model's config: checked before its weights load)."""
    want = (text_cfg.num_hidden_layers, text_cfg.num_key_value_heads, text_cfg.hidden_size)
    have = (config.num_layers, config.num_kv_heads, config.hidden_size)
    if want != have:
        raise GatesMismatchError(
            "gates do not match this model: gates have (layers, kv_heads, hidden) = "
            f"{have}, the model has {want}; use gates trained for this base model "
            f"({config.base_model or 'unknown base'})"
        )


def check_gates_match(model: nn.Module, config: GateConfig) -> None:
    """Raise a clear error when gates were built for a base model of other shapes; warn when they were trained for
    another architecture of the same shapes.

    The gates' ``base_architecture`` (:func:`architecture_fingerprint` of their base model's config) is compared with
    the model's: a base model and its fine-tunes, or one model loaded from the Hub and from a local copy, share it, so
    none of them warns. Gates from before it was recorded fall back to the names' stems (:func:`model_stem`), unless
    the model's name is a local path, which says nothing about what model it holds."""
    cfg = text_config_of(model)
    check_gates_shape(cfg, config)
    top = getattr(unwrap(model), "config", cfg)
    model_name = getattr(cfg, "_name_or_path", "") or getattr(top, "_name_or_path", "")
    if config.base_architecture is not None:
        if config.base_architecture == architecture_fingerprint(top):
            return
        this, found = model_name or type(unwrap(model)).__name__, architecture_fingerprint(top)
        said = (f"these gates were trained for {config.base_model or 'a base model'} (architecture "
                f"{config.base_model_type or '?'}, fingerprint {config.base_architecture}), and the model {this} is "
                f"another architecture ({getattr(top, 'model_type', '?')}, fingerprint {found})")
    else:
        trained_for, this = model_stem(config.base_model), model_stem(model_name)
        if not (trained_for and this and trained_for != this) or _local_path(model_name):
            return
        said = f"these gates were trained for {config.base_model}, and the model is {model_name}"
    import warnings

    # same shapes, so they load; but a gate scores the hidden states of the model it was trained on
    warnings.warn(f"{said}: the shapes match, so they load, but their scores were learned on the other model's "
                  "hidden states; train gates for this model (train.py) for eviction you can trust")


def _local_path(name: str) -> bool:
    """Whether a model's ``_name_or_path`` is a folder on this machine (or can only be a path), not a Hub id."""
    from pathlib import Path

    return looks_like_a_path(name) or Path(name).expanduser().exists()
