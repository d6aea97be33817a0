"""Retention gates: config validation, shapes, tying of the readout, batching over heads, persistence."""

import json

import pytest
import torch
import torch.nn.functional as F

from retention.gates import GateConfig, RetentionGates

L, H, D = 3, 2, 24


def make(variant="global", **kw):
    torch.manual_seed(0)
    return RetentionGates(GateConfig(num_layers=L, num_kv_heads=H, hidden_size=D, variant=variant, gate_hidden=8, **kw))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(variant="nope"), "variant must be one of"),
        (dict(num_layers=0), "num_layers must be a positive integer"),
        (dict(gate_hidden=2.5), "gate_hidden must be a positive integer"),
        (dict(activation="swish"), "activation must be one of"),
        (dict(bias_init=float("nan")), "bias_init must be a finite number"),
    ],
)
def test_config_rejects_bad_values(bad, match):
    args = dict(num_layers=L, num_kv_heads=H, hidden_size=D) | bad
    with pytest.raises(ValueError, match=match):
        GateConfig(**args)


def test_config_round_trip_and_unknown_keys():
    cfg = GateConfig(num_layers=L, num_kv_heads=H, hidden_size=D, variant="seed", extra={"note": 1})
    assert GateConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown GateConfig keys \\['colour'\\]"):
        GateConfig.from_dict(cfg.to_dict() | {"colour": "red"})


@pytest.mark.parametrize("variant", ["global", "seed", "trimkv"])
def test_shapes_range_and_init_near_one(variant):
    gates = make(variant)
    x = torch.randn(2, 7, D)
    for layer in range(L):
        lb = gates(layer, x)
        assert lb.shape == (2, H, 7) and lb.dtype == torch.float32
        assert (lb <= 0).all()
        assert (lb > -1e-6).all(), "beta must start near 1 so the student starts as the teacher"


@pytest.mark.parametrize("variant", ["global", "seed", "trimkv"])
def test_a_seed_draws_the_same_initial_gates_in_every_process_and_leaves_the_global_rng_alone(variant):
    """Untrained gates at inference are seeded: without it each process drew another ranking (``retention demo``
    replied differently run to run, and a resumed ``gates: untrained`` sweep scored its gated rows again)."""
    cfg = GateConfig(num_layers=L, num_kv_heads=H, hidden_size=D, variant=variant, gate_hidden=8)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    a = RetentionGates(cfg, seed=0)
    assert torch.equal(torch.get_rng_state(), state)  # a training run's seeded stream is not consumed
    torch.manual_seed(2)
    assert RetentionGates(cfg, seed=0).fingerprint() == a.fingerprint()
    assert RetentionGates(cfg, seed=1).fingerprint() != a.fingerprint()
    torch.manual_seed(3)
    b = RetentionGates(cfg)  # no seed: torch's global RNG, as training seeds it
    torch.manual_seed(3)
    assert RetentionGates(cfg).fingerprint() == b.fingerprint() != a.fingerprint()


@pytest.mark.parametrize("variant", ["global", "seed", "trimkv"])
def test_batched_heads_equal_a_loop_over_heads(variant):
    gates = make(variant, bias_init=0.5)
    x = torch.randn(2, 5, D, dtype=torch.float64).float()
    for layer in range(L):
        got = gates(layer, x)
        for h in range(H):
            e = h if variant == "global" else 0
            phi = F.silu(x @ gates.W1[layer, e] + gates.b1[layer, e])
            row = {"global": 0, "seed": h, "trimkv": layer * H + h}[variant]
            want = F.logsigmoid(phi @ gates.w[row] + gates.b[row])
            torch.testing.assert_close(got[:, h], want, rtol=1e-5, atol=1e-6)


def test_readout_shapes_encode_what_is_tied():
    shapes = {v: (tuple(make(v).W1.shape), tuple(make(v).w.shape)) for v in ("global", "seed", "trimkv")}
    assert shapes["global"] == ((L, H, D, 8), (1, 8))  # per-head MLP, one readout for all
    assert shapes["seed"] == ((L, 1, D, 8), (H, 8))  # per-layer MLP, a row per KV head tied over layers
    assert shapes["trimkv"] == ((L, 1, D, 8), (L * H, 8))  # nothing tied


def test_shared_readout_moves_every_layer_and_head():
    gates = make("global", bias_init=0.0)
    x = torch.randn(1, 4, D)
    before = torch.stack([gates(layer, x) for layer in range(L)])
    with torch.no_grad():
        gates.b += 1.0
    after = torch.stack([gates(layer, x) for layer in range(L)])
    assert (after > before).all()


@pytest.mark.parametrize("variant", ["global", "trimkv"])
def test_gates_score_in_their_own_dtype_and_return_float32(variant):
    """DeepSpeed's bf16 engine casts the trained module, gates included, to bf16 while the model's hidden states may
    be float32 (seen on an H200 and on DeepSpeed's CPU accelerator: ZeRO-2 in bf16 stopped at the first step). The
    gates score in their weights' dtype, from hidden states of any dtype, and always return float32 log-beta."""
    g = make(variant)
    x = torch.randn(2, 5, D)
    ref = g(1, x)
    g16 = make(variant).to(torch.bfloat16)
    for inp in (x, x.bfloat16()):
        out = g16(1, inp)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)
    assert g(1, x.bfloat16()).dtype == torch.float32  # float32 gates on a bf16 model


def test_wrong_hidden_size_is_a_clear_error():
    with pytest.raises(ValueError, match="hidden size 5, gates were built for 24"):
        make()(0, torch.randn(1, 3, 5))


def test_save_and_load_round_trip(tmp_path):
    gates = make("trimkv", bias_init=1.0)
    gates.save_pretrained(tmp_path / "g", metadata={"base_model": "tiny"})
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["README.md", "gates.safetensors", "retention.json"]
    state = torch.random.get_rng_state()
    loaded = RetentionGates.from_pretrained(tmp_path / "g")
    assert torch.equal(torch.random.get_rng_state(), state)  # loading draws nothing: a seeded run's draws stay its own
    assert loaded.config == GateConfig(**{**gates.config.to_dict(), "base_model": "tiny"})  # the base, named
    for k, v in gates.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    x = torch.randn(1, 3, D)
    assert torch.equal(gates(2, x), loaded(2, x))
    assert json.loads((tmp_path / "g" / "retention.json").read_text())["base_model"] == "tiny"


def test_load_missing_files_names_them(tmp_path):
    from retention.gates import GateCheckpointError

    with pytest.raises(GateCheckpointError, match="retention.json"):  # a user error: commands print it, no traceback
        RetentionGates.from_pretrained(tmp_path)


def test_from_pretrained_finds_a_shipped_name_and_names_a_missing_folder(tmp_path, monkeypatch):
    """Not only folders: a shipped checkpoint's name loads the package's copy (as load_gates does), and a path that
    does not exist gets the error naming it, before any Hub call."""
    from retention.hub import HubError, load_gates
    from retention.models import shipped_checkpoint

    if shipped_checkpoint("smollm2-135m-global") is None:
        pytest.fail("the shipped gates are missing from checkpoints/")
    named = RetentionGates.from_pretrained("smollm2-135m-global")
    assert named.fingerprint() == load_gates("smollm2-135m-global").fingerprint()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HubError, match="there is no such folder"):
        RetentionGates.from_pretrained("./nowhere")


@pytest.mark.parametrize("variant", ["global", "seed", "trimkv"])
def test_widened_gates_score_as_before_and_can_learn_with_the_new_units(variant):
    gates = make(variant, bias_init=0.5)
    with torch.no_grad():
        gates.b1.normal_()  # a trained checkpoint's biases are not zero
    wide = gates.widened(20, generator=torch.Generator().manual_seed(1))
    assert wide.config.gate_hidden == 20 and wide.W1.shape[-1] == 20 and wide.w.shape[-1] == 20
    x = torch.randn(2, 6, D)
    for layer in range(L):
        torch.testing.assert_close(wide(layer, x), gates(layer, x), rtol=1e-6, atol=1e-6)  # summation order only
    assert wide.W1[..., 8:].abs().sum() > 0  # the new units see the input ...
    wide(0, x).sum().backward()
    assert wide.w.grad[:, 8:].abs().sum() > 0  # ... so their readout, 0 now, gets a gradient
    assert gates.config.gate_hidden == 8  # the source is left as it was


def test_widening_refuses_to_narrow():
    with pytest.raises(ValueError, match="width >= 8"):
        make().widened(4)
