"""Replies decoded through :class:`~retention.cache.GraphDecoder` (``cuda_graphs=True``): each step after the first
a replayed CUDA graph, with the logits processors ``generate`` would apply."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .template import _ids

# generation-config settings that change the logits or end a reply and that the graph path does not apply, at their
# no-op values: a model whose config sets one decodes through generate, not GraphDecoder
_PLAIN_GENERATION = {"no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None,
                     "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                     "sequence_bias": None, "min_length": 0, "min_new_tokens": None, "renormalize_logits": False,
                     "exponential_decay_length_penalty": None, "guidance_scale": None,
                     "encoder_repetition_penalty": 1.0, "stop_strings": None}
# sampling settings the graph path applies itself (with transformers' own logits warpers, in generate's order, after
# the repetition penalty); one left unset (None) in the call and the generation config takes transformers' global
# default, as generate does
_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}
# sampling warpers the graph path does not apply: a model whose generation config sets one samples through generate
_OTHER_SAMPLING = {"top_h": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


class GraphDecodingMixin:
    """Graph decoding of :class:`~retention.chat.RetentionChat`."""

    def _setting(self, kwargs: dict[str, Any], name: str, default: Any) -> Any:
        """A generation setting as generate resolves it: the call's, else the model's generation config's, else
        transformers' global ``default``."""
        value = kwargs[name] if name in kwargs else getattr(self.model.generation_config, name, None)
        return default if value is None else value

    def _graphs_decode(self, kwargs: dict[str, Any]) -> bool:
        """Whether this reply can decode through GraphDecoder: greedy or sampled (temperature, top_k, top_p, min_p),
        with at most a repetition penalty changing the logits (the model's generation config included). Otherwise it
        goes through generate, with a warning that says why."""
        plain = {"do_sample", "max_new_tokens", "min_new_tokens", "eos_token_id", "stopping_criteria",
                 "prefill_chunk_size", "repetition_penalty", "pad_token_id", *_SAMPLING}
        others = {**_PLAIN_GENERATION, **(_OTHER_SAMPLING if kwargs.get("do_sample") else {})}
        gc = self.model.generation_config
        changed = {name: getattr(gc, name, None) for name, default in others.items()
                   if getattr(gc, name, default) not in (default, None)}
        why = (f"{', '.join(sorted(set(kwargs) - plain))} given" if set(kwargs) - plain else
               f"the model's generation config sets {changed}" if changed else None)
        if why:
            warnings.warn(f"cuda_graphs: this reply decodes with generate, since {why}", stacklevel=4)
        return why is None

    def _graph_processors(self, kwargs: dict[str, Any], prompt_length: int, eos: list[int]) -> Any:
        """The logits processors generate would apply to this reply's scores, in its order: the repetition penalty,
        no eos before min_new_tokens, then (when sampling) temperature, top-k, top-p and min-p."""
        from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                  RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                                  TopPLogitsWarper)

        out = LogitsProcessorList()
        penalty = self._setting(kwargs, "repetition_penalty", 1.0)
        if penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(penalty))
        if (kwargs.get("min_new_tokens") or 0) > 0 and eos:
            out.append(MinNewTokensLengthLogitsProcessor(prompt_length, kwargs["min_new_tokens"], eos,
                                                         device=str(self.device)))
        if not kwargs.get("do_sample"):
            return out
        s = {name: self._setting(kwargs, name, default) for name, default in _SAMPLING.items()}
        if s["temperature"] != 1.0:
            out.append(TemperatureLogitsWarper(s["temperature"]))
        if s["top_k"] != 0:
            out.append(TopKLogitsWarper(s["top_k"]))
        if s["top_p"] < 1.0:
            out.append(TopPLogitsWarper(s["top_p"]))
        if s["min_p"] is not None:
            out.append(MinPLogitsWarper(s["min_p"]))
        return out

    def _graph_generate(self, full: torch.Tensor, kwargs: dict[str, Any], streamer: Any) -> torch.Tensor:
        """Decoding as ``generate`` does it (chunked prefill, min_new_tokens, eos, stopping criteria, the streamer,
        greedy or sampled from the processed scores), each step after the first a
        :class:`~retention.cache.GraphDecoder` replay. Returns ``full`` plus the reply, ``(1, T + n)``; the cache
        holds every token but the last, as after generate."""
        from ..cache import GraphDecoder
        from ..compat import cache_kwargs

        given = kwargs.get("eos_token_id")  # as generate reads them: given ids replace the generation config's
        eos = sorted(set(_ids(given if given is not None else self.model.generation_config.eos_token_id)))
        criteria = kwargs.get("stopping_criteria") or []
        # built before the prefill, so a setting the processors refuse (top_k=-1) leaves the cache as it was
        processors, sample = self._graph_processors(kwargs, full.shape[1], eos), bool(kwargs.get("do_sample"))
        streamer.put(full)  # the prompt, which the streamer skips (as generate hands it over)
        for start in range(self.cache.get_seq_length(), full.shape[1], self.chunk_size):
            logits = self.model(input_ids=full[:, start : start + self.chunk_size], **cache_kwargs(self.cache),
                                use_cache=True).logits[:, -1]
        if self._decoder is None or self._decoder.cache is not self.cache:
            self._decoder = GraphDecoder(self.model, self.cache, graph=self._graph_replay)
        out = full
        for n in range(kwargs["max_new_tokens"]):
            scores = processors(out, logits.float())  # generate processes float32 scores
            new = (torch.multinomial(scores.softmax(-1), num_samples=1) if sample
                   else scores.argmax(-1, keepdim=True))  # (1, 1)
            out = torch.cat([out, new], dim=1)
            streamer.put(new[0])
            if (int(new) in eos or n + 1 == kwargs["max_new_tokens"]
                    or any(bool(c(out, scores).any()) for c in criteria)):
                break
            logits = self._decoder.step(new)
        streamer.end()
        return out
