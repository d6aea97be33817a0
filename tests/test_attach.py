"""Attaching gates to tiny random Llama / Qwen2 / Qwen3 / Qwen3-VL models."""

import pytest
import torch

import retention.attach as attach_mod
from retention import GateConfig, UnsupportedModelError, attach_gates
from retention.ops.retention_attention import retention_attention_naive
from kernel_checks import student_matches_oracle
from tiny_models import BUILDERS, tiny_llama, tiny_qwen3_vl, vl_inputs

ARCHS = list(BUILDERS)


def inputs_for(arch, batch=2, seqlen=19, seed=0):
    if arch == "qwen3_vl":
        return vl_inputs(seed=seed)
    g = torch.Generator().manual_seed(seed)
    return dict(input_ids=torch.randint(0, 100, (batch, seqlen), generator=g))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_teacher_mode_equals_unpatched_model_exactly(arch, impl):
    model = BUILDERS[arch](attn_implementation=impl)
    x = inputs_for(arch)
    with torch.no_grad():
        want = model(**x).logits
        att = attach_gates(model)
        with att.teacher():
            got = model(**x).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_student_with_beta_one_equals_unpatched(arch):
    model = BUILDERS[arch]()
    x = inputs_for(arch)
    with torch.no_grad():
        want = model(**x).logits
        att = attach_gates(model, bias_init=1e4)  # logsigmoid(1e4) == 0 exactly in fp32
        got = model(**x).logits
    assert all((lb == 0).all() for lb in att.log_betas())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_student_equals_brute_force_with_gradients(arch, monkeypatch):
    """Random log_beta: logits and gate gradients equal a run whose attention is the materialised oracle."""
    model = BUILDERS[arch]()
    att = attach_gates(model, bias_init=0.0)  # beta ~ 0.5: strong decay
    student_matches_oracle(model, att, inputs_for(arch), monkeypatch)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["teacher", "student"])
def test_packed_documents_equal_each_document_alone(arch, mode):
    model = BUILDERS[arch]()
    attach_gates(model, bias_init=0.0, mode=mode)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 100, (1, n), generator=g) for n in (7, 12, 5)]
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    with torch.no_grad():
        # use_cache=False as in training: transformers builds the packed mask only without a cache
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        start = 0
        for d in docs:
            alone = model(input_ids=d).logits
            torch.testing.assert_close(packed[:, start : start + d.shape[1]], alone, rtol=1e-5, atol=1e-5)
            start += d.shape[1]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sink_tokens_never_decay_in_each_packed_document(arch, monkeypatch):
    """With ``sink=2`` the first 2 tokens of every packed document get log_beta 0 (what the losses read)
    and the attention equals the oracle run on those masked scores; without it they decay."""
    model = BUILDERS[arch]()
    att = attach_gates(model, bias_init=0.0)  # beta ~ 0.5 everywhere
    g = torch.Generator().manual_seed(2)
    lens = (7, 12, 5)
    ids = torch.randint(0, 100, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    starts = [0, 7, 19]
    sinks = torch.zeros(sum(lens), dtype=torch.bool)
    for s0 in starts:
        sinks[s0 : s0 + 2] = True
    with torch.no_grad():
        plain = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert all((lb[..., sinks] < 0).all() for lb in att.log_betas())
        att.sink = 2
        got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        for lb in att.log_betas():
            assert (lb[..., sinks] == 0).all() and (lb[..., ~sinks] < 0).all()
        seen = []

        def naive(q, k, v, lb, scale=None, cu_seqlens=None):
            seen.append(lb.clone())
            return retention_attention_naive(q, k, v, lb, scale, cu_seqlens)[0]

        monkeypatch.setattr(attach_mod, "retention_attention", naive)
        want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert all((lb[..., sinks] == 0).all() for lb in seen)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-4)  # keeping the sinks changed the output


def test_a_sink_as_long_as_the_row_makes_the_student_the_teacher():
    model = tiny_llama()
    att = attach_gates(model, bias_init=0.0)
    x = inputs_for("llama")
    with torch.no_grad():
        with att.teacher():
            want = model(**x).logits
        att.sink = x["input_ids"].shape[1]
        got = model(**x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sink_mask_marks_the_start_of_each_document():
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    m = attach_mod.sink_mask(2, 5, cu, 2, torch.device("cpu"))
    want = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(m, want)
    assert torch.equal(attach_mod.sink_mask(2, 4, None, 3, torch.device("cpu")),
                       torch.tensor([[1, 1, 1, 0]] * 2, dtype=torch.bool))


def test_explicit_cu_seqlens_match_position_restarts():
    model = tiny_llama()
    attach_gates(model, bias_init=0.0)
    ids = torch.randint(0, 100, (1, 20))
    pos = torch.cat([torch.arange(8), torch.arange(12)])[None]
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=pos).logits
        cu = torch.tensor([0, 8, 20], dtype=torch.int32)
        b = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits
    torch.testing.assert_close(a, b)


def test_document_restarts_are_found_once_per_forward_not_once_per_layer(monkeypatch):
    """Finding a packed row's documents in position_ids waits for the device; every layer of a forward gets the same
    position_ids, so it is done once (a sync per layer kept a GPU training step from running ahead). New positions
    in the same tensor, or a new tensor, are read again."""
    model = tiny_llama()
    assert model.config.num_hidden_layers > 1
    attach_gates(model, bias_init=0.0)
    calls = []
    real = attach_mod._restarts
    monkeypatch.setattr(attach_mod, "_restarts", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, 100, (1, 20))
    pos = torch.cat([torch.arange(8), torch.arange(12)])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos).logits
        assert len(calls) == 1
        pos[0, 8:] += 8  # one document now: the same tensor, changed in place
        whole = model(input_ids=ids, position_ids=pos).logits
        assert len(calls) == 2
        assert torch.equal(whole, model(input_ids=ids, position_ids=torch.arange(20)[None]).logits)
    assert len(calls) == 3
    assert not torch.allclose(packed[0, 8:], whole[0, 8:])  # the first forward did see two documents


@pytest.mark.parametrize("arch", ARCHS)
def test_only_gate_parameters_train(arch):
    model = BUILDERS[arch]()
    att = attach_gates(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"retention_gates.{n}" for n, _ in att.gates.named_parameters()}
    model(**inputs_for(arch)).logits.sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("retention_gates."))


def test_gates_see_the_normed_attention_input():
    model = tiny_llama()
    att = attach_gates(model)
    seen = {}
    layer0 = model.model.layers[0]

    def grab(module, args, kwargs):
        seen["h"] = kwargs.get("hidden_states", args[0] if args else None)

    layer0.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (1, 6)))
    torch.testing.assert_close(att.log_betas()[0], att.gates(0, layer0.input_layernorm(seen["h"])))


def test_vision_tokens_are_gated():
    model = BUILDERS["qwen3_vl"]()
    att = attach_gates(model)
    x = vl_inputs(n_images=2)
    with torch.no_grad():
        model(**x)
    assert all(lb.shape == (1, 2, x["input_ids"].shape[1]) for lb in att.log_betas())


def test_unsupported_architecture_lists_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(UnsupportedModelError,
                       match="model_type 'gpt2'.*supported: \\['llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_vl'\\]"):
        attach_gates(model)


@pytest.mark.parametrize("arch,window", [("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                                        max_window_layers=1)),
                                         ("mistral", dict(sliding_window=8))])
def test_sliding_window_layers_are_refused_with_the_keywords_that_turn_them_off(arch, window, tmp_path):
    """The gated attention and the retention cache ignore a window, so a model with one would silently stop
    matching itself (student and cache alike): refused from the config, before load_model reads weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from retention import load_model

    model = BUILDERS[arch](**window)
    with pytest.raises(UnsupportedModelError, match="sliding-window attention layers \\(8 tokens\\)"):
        attach_gates(model)
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # proves the refusal comes before reading them
    with pytest.raises(UnsupportedModelError, match="load_model\\(\\.\\.\\., sliding_window=None") as err:
        load_model(str(tmp_path))
    # the keywords the message names give a model with every layer full: the same as one built without a window
    keywords = eval("dict(" + str(err.value).split("load_model(..., ")[1].split(")")[0] + ")")
    model.save_pretrained(tmp_path)
    config, rest = AutoConfig.from_pretrained(tmp_path, return_unused_kwargs=True, **keywords)
    unwindowed = AutoModelForCausalLM.from_pretrained(tmp_path, config=config, **rest).eval()
    x = inputs_for(arch)  # 19 tokens: past the window
    with torch.no_grad():
        assert torch.equal(unwindowed(**x).logits, BUILDERS[arch]()(**x).logits)
        assert not torch.allclose(model(**x).logits, BUILDERS[arch]()(**x).logits, atol=1e-3)
    attach_gates(unwindowed)  # accepted now


def test_gates_for_another_model_are_refused():
    model = tiny_llama()
    cfg = GateConfig(num_layers=30, num_kv_heads=3, hidden_size=576, base_model="smollm2")
    with pytest.raises(ValueError, match="gates do not match this model.*\\(30, 3, 576\\).*\\(3, 2, 96\\)"):
        attach_gates(model, cfg)


def test_attach_twice_is_refused_and_detach_restores():
    model = tiny_llama()
    x = inputs_for("llama")
    with torch.no_grad():
        want = model(**x).logits
    att = attach_gates(model, bias_init=0.0)
    with pytest.raises(RuntimeError, match="already has retention gates"):
        attach_gates(model)
    plain = att.detach()
    assert not hasattr(plain, "retention_gates") and plain.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(plain(**x).logits, want)
    attach_gates(plain)  # attaching again works


def test_a_bad_mode_leaves_the_model_untouched_and_a_detached_handle_says_so():
    """attach_gates(mode="bogus") raised only after freezing the base and adding the gates; after detach() the
    handle's student() silently ran the plain model and a second detach() was an AttributeError."""
    model = tiny_llama()
    with pytest.raises(ValueError, match="mode must be one of"):
        attach_gates(model, mode="bogus")
    assert all(p.requires_grad for p in model.parameters()) and not hasattr(model, "retention_gates")
    assert getattr(model, "retention", None) is None
    att = attach_gates(model)
    assert not any(p.requires_grad for n, p in model.named_parameters() if not n.startswith("retention_gates"))
    att.detach()
    assert all(p.requires_grad for p in model.parameters())  # the plain model, as it was before attaching
    assert att.detach() is model  # twice: nothing more to do
    for use in (lambda: att.student().__enter__(), lambda: att.teacher().__enter__(), att.log_betas, att.reset,
                lambda: att.set_mode("score")):
        with pytest.raises(RuntimeError, match="detached from the model"):
            use()


def test_student_generation_with_cache_matches_full_recompute():
    """Student mode keeps past gate scores for cached keys: cached decoding equals recomputing all."""
    model = tiny_llama()
    att = attach_gates(model, bias_init=0.0)
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        att.reset()
        full = model(input_ids=out).logits
    torch.testing.assert_close(full[0, 8:-1].argmax(-1), out[0, 9:])


def test_mode_validation():
    att = attach_gates(tiny_llama())
    with pytest.raises(ValueError, match="mode must be one of"):
        att.set_mode("bogus")


def test_use_gates_scores_with_other_gates_and_restores():
    """``use_gates`` swaps who scores (for comparing checkpoints on one attached model), then restores."""
    from retention import RetentionGates

    model = tiny_llama()
    att = attach_gates(model, mode="score", bias_init=3.0)
    other = RetentionGates(GateConfig.for_model(model, bias_init=-1.0))
    x = inputs_for("llama")
    with torch.no_grad():
        model(**x)
        mine = [b.clone() for b in att.log_betas()]
        with att.use_gates(other):
            model(**x)
            theirs = [b.clone() for b in att.log_betas()]
        model(**x)
        again = att.log_betas()
    assert all(torch.equal(a, b) for a, b in zip(mine, again))
    assert all(float(t.mean()) < float(m.mean()) - 1 for t, m in zip(theirs, mine))  # bias -1 vs 3: lower beta
    assert model.retention_gates is att.gates and att.gates is not other
    with pytest.raises(ValueError, match="do not match"):
        with att.use_gates(RetentionGates(GateConfig(num_layers=1, num_kv_heads=1, hidden_size=8))):
            pass


def test_cache_kwargs_names_the_argument_this_transformers_takes():
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache``: ours must match the installed one."""
    import inspect

    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaModel

    from retention.compat import CACHE_KWARG, cache_kwargs, output_cache

    assert CACHE_KWARG in inspect.signature(LlamaModel.forward).parameters
    assert CACHE_KWARG in inspect.signature(LlamaAttention.forward).parameters
    assert cache_kwargs("c") == {CACHE_KWARG: "c"}
    model = tiny_llama()
    out = model(input_ids=torch.arange(7)[None], use_cache=True)
    assert output_cache(out).get_seq_length() == 7  # the returned cache, whatever its field is called


def test_activation_checkpointing_is_enabled_under_this_transformers_name():
    """transformers 5.24 renamed ``gradient_checkpointing_enable``; the old name warns (FutureWarning)."""
    import warnings

    from retention.compat import enable_activation_checkpointing

    model = tiny_llama()
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_activation_checkpointing(model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_student_mode_refuses_a_padded_batch_instead_of_attending_to_the_padding():
    """The gated attention takes no padding mask: a padded batch in student mode silently attended to the pad
    tokens. Plain, all-ones and packed batches still run; a padded one names score mode and packing."""
    model = tiny_llama()
    att = attach_gates(model)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[1, :4] = 0
    packed = torch.cat([torch.arange(6), torch.arange(6)])[None].expand(2, 12)
    with torch.no_grad(), att.student():
        plain = model(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, plain)
        model(input_ids=ids, position_ids=packed)
        with pytest.raises(ValueError, match="student mode does not support padded batches.*score mode"):
            model(input_ids=ids, attention_mask=padded)


def test_student_mode_refuses_a_padded_batch_under_flex_attention():
    """Under flex_attention the mask reaches the layers as a BlockMask, which the padding check skipped: the
    padded batch trained on its pad tokens. It is refused as a dense mask's is; an unpadded one runs."""
    model = tiny_llama(attn_implementation="flex_attention")
    att = attach_gates(model)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[1, :4] = 0
    with torch.no_grad(), att.student():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits,
                                   model(input_ids=ids).logits)
        with pytest.raises(ValueError, match="student mode does not support padded batches"):
            model(input_ids=ids, attention_mask=padded)


def _warnings_of(model, config) -> list[str]:
    import warnings

    from retention.attach import check_gates_match

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_gates_match(model, config)
    return [str(w.message) for w in caught if "the shapes match" in str(w.message)]


def test_gates_from_before_the_architecture_was_recorded_compare_names_but_not_local_paths(tmp_path):
    """An old checkpoint (no base_architecture) falls back to the names' stems, as before, but a model loaded from a
    folder is never warned about: its name says where it is, not which model it is (SmolLM2 from a local copy
    warned against gates trained on SmolLM2 from the Hub)."""
    model = tiny_llama()
    old = {**GateConfig.for_model(model).to_dict(), "base_model_type": None, "base_architecture": None}
    for name, base, warned in (("someone/Tiny-Instruct", "someone/Tiny-Base", True),
                               ("someone/Tiny-Instruct", "/local/models/tiny-instruct", False),
                               ("someone/Tiny-Instruct", "", False),
                               ("/local/models/tiny-base", "someone/Tiny-Instruct", False),
                               (str(tmp_path), "someone/Tiny-Instruct", False)):  # an existing folder
        model.config._name_or_path = name
        said = _warnings_of(model, GateConfig(**{**old, "base_model": base}))
        assert bool([m for m in said if f"trained for {base}" in m]) == warned, (name, base)


def test_gates_warn_only_when_the_base_models_architecture_fingerprint_differs():
    """New gates record the fingerprint of their base model's config: the same model under another name (a local
    copy, a fine-tune) is no warning; another architecture of the same gate shapes is, whatever the names say."""
    from retention.architecture import architecture_fingerprint

    model = tiny_llama()
    model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    cfg = GateConfig.for_model(model)
    assert cfg.base_model_type == "llama" and cfg.base_architecture == architecture_fingerprint(model.config)
    # the embedded cache folder and a fine-tune: both used to warn, their names differing from the Hub id
    for name in ("/home/me/.cache/retention/models/smollm2-135m-86c4f5238766f35c", "someone/SmolLM2-135M-finetuned",
                 ""):
        model.config._name_or_path = name
        assert _warnings_of(model, cfg) == [], name
    other = tiny_llama(vocab_size=100, rope_theta=500000.0)  # the same layers, KV heads and width: the gates load
    assert architecture_fingerprint(other.config) != cfg.base_architecture
    (said,) = _warnings_of(other, cfg)
    assert f"fingerprint {cfg.base_architecture}" in said and "trained for HuggingFaceTB/SmolLM2-135M-Instruct" in said


def test_an_unknown_gate_option_or_a_bias_that_is_no_number_is_named():
    """attach_gates(model, hidden=0) said only "GateConfig.__init__() got an unexpected keyword argument", and
    bias_init="x" "could not convert string to float": both now name the option and what it takes."""
    from tiny_models import tiny_llama

    model = tiny_llama().eval()
    with pytest.raises(TypeError, match=r"unknown gate option\(s\) \['hidden'\]; the options are \['activation'"):
        attach_gates(model, None, hidden=0)
    for bias in ("x", True, float("nan")):
        with pytest.raises(ValueError, match="GateConfig.bias_init must be a finite number"):
            attach_gates(model, None, bias_init=bias)
    assert getattr(model, "retention", None) is None
    attach_gates(model, None, gate_hidden=8, bias_init=5).detach()  # an int bias is a number


def test_a_seed_builds_the_same_new_gates_and_is_refused_with_built_ones():
    from retention.gates import RetentionGates

    model = tiny_llama().eval()
    torch.manual_seed(1)
    a = attach_gates(model, None, seed=0).gates
    model.retention.detach()
    torch.manual_seed(2)
    assert attach_gates(model, None, seed=0).gates.fingerprint() == a.fingerprint()
    model.retention.detach()
    built = RetentionGates(GateConfig.for_model(model))
    with pytest.raises(ValueError, match="seed are only used when building new gates"):
        attach_gates(model, built, seed=0)
    assert getattr(model, "retention", None) is None


def test_gates_attached_through_the_causal_lm_are_not_attached_again_through_its_decoder():
    """attach_gates(model.model) after attach_gates(model) was accepted: every layer got a second hook, the outer
    handle's teacher mode no longer ran the plain model, and either detach() broke the other's forward."""
    model = tiny_llama()
    x = inputs_for("llama")
    with torch.no_grad():
        want = model(**x).logits
    outer = attach_gates(model, mode="teacher")
    with pytest.raises(RuntimeError, match="layers already have retention gates attached.*LlamaForCausalLM"):
        attach_gates(model.model)
    assert len(model.model.layers[0].self_attn._forward_pre_hooks) == 1 and not hasattr(model.model, "retention")
    with torch.no_grad():
        assert torch.equal(model(**x).logits, want)
    outer.detach()
    inner = attach_gates(model.model, mode="teacher")  # the other way round, too
    with pytest.raises(RuntimeError, match="layers already have retention gates attached.*LlamaModel"):
        attach_gates(model)
    inner.detach()
    with torch.no_grad():
        assert torch.equal(model(**x).logits, want)


def test_cached_student_decoding_keeps_the_sink_of_a_prompt_shorter_than_it():
    """With sink=4 and a 2-token prompt, the prefill kept tokens 0-1 at log_beta 0 but cached decoding let tokens
    2-3 decay, where a forward over the whole sequence keeps them too: generation and recompute disagreed."""
    model = tiny_llama()
    att = attach_gates(model, bias_init=-2.0)  # beta ~ 0.12: a sink that is not kept changes the output
    att.sink = 4
    ids = torch.randint(0, 100, (1, 2), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        assert all((lb[..., -1] < 0).all() for lb in att.log_betas())  # the last token (past the sink) decays
        att.reset()
        full = model(input_ids=out.sequences).logits
    torch.testing.assert_close(torch.stack(out.logits, 1)[0], full[0, 1:-1], rtol=1e-5, atol=1e-5)


def test_the_architecture_fingerprint_reads_the_same_config_fields_under_either_rope_layout():
    """rope_theta is an attribute before transformers 5 and in rope_parameters since: one model, one fingerprint."""
    from types import SimpleNamespace

    from retention.architecture import architecture_fields, architecture_fingerprint

    fields = dict(model_type="llama", num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9,
                  hidden_size=576, head_dim=64, vocab_size=49152, intermediate_size=1536)
    old = SimpleNamespace(**fields, rope_theta=100000)
    new = SimpleNamespace(**fields, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    assert architecture_fields(old) == architecture_fields(new) == {**fields, "rope_theta": 100000.0}
    assert architecture_fingerprint(old) == architecture_fingerprint(new)
    assert len(architecture_fingerprint(old)) == 12
    missing = SimpleNamespace(**{**fields, "head_dim": None})  # a field the config lacks is left out
    assert "head_dim" not in architecture_fields(missing)
    assert architecture_fingerprint(missing) != architecture_fingerprint(old)
    vl = tiny_qwen3_vl()  # the vision-language model's own type; the decoder's fields
    assert architecture_fields(vl.config)["model_type"] == "qwen3_vl"
    assert architecture_fields(vl.config)["num_hidden_layers"] == vl.config.text_config.num_hidden_layers
