"""Gate checkpoints: export, load (with base-model checks), and Hub upload over a faked HTTP layer."""

import base64
import json
from pathlib import Path

import httpx2 as httpx  # the HTTP client huggingface_hub 2.x uses
import pytest
import torch

from retention import attach_gates
from retention.gates import GateCheckpointError, GateConfig, RetentionGates
from retention.hub import HubError, export_gates, load_gates, push_to_hub
from tiny_models import tiny_llama, tiny_qwen3


@pytest.fixture
def checkpoint(tmp_path):
    model = tiny_llama()
    # gates trained from a local copy of the base name that folder; the checkpoint must name the base
    gates = RetentionGates(GateConfig.for_model(model, bias_init=2.0, base_model="/home/me/.cache/tiny-llama-0f3a"))
    path = export_gates(gates, tmp_path / "ckpt", base_model="tiny-llama", budget="64 entries", training={"steps": 3})
    return path, gates, model


def test_export_writes_a_self_describing_checkpoint(checkpoint):
    path, gates, _ = checkpoint
    # retention.json: never config.json, a name transformers takes for a model's config
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "gates.safetensors", "retention.json"]
    cfg = json.loads((path / "retention.json").read_text())
    assert (cfg["gate_config"] == {**gates.config.to_dict(), "base_model": "tiny-llama"}
            and cfg["budget"] == "64 entries")
    assert RetentionGates.from_pretrained(path).config.base_model == "tiny-llama"
    card = (path / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: retention\nbase_model: tiny-llama\n")
    assert "| steps | 3 |" in card


def test_export_never_replaces_a_folder_of_other_files(checkpoint, tmp_path):
    """The export swaps its whole folder: `--to ~/work` used to delete everything in it. Earlier gates (a re-export)
    and empty folders are replaced; anything else is refused with nothing touched."""
    path, gates, _ = checkpoint
    work = tmp_path / "work"
    work.mkdir()
    (work / "thesis.txt").write_text("years of it")
    (work / "config.json").write_text('{"model_type": "llama"}')  # a model folder is no gate folder either
    for write in (lambda p: export_gates(gates, p), lambda p: gates.save_pretrained(p)):
        with pytest.raises(FileExistsError, match="does not hold a gate checkpoint.*choose a new or empty folder"):
            write(work)
        assert sorted(p.name for p in work.iterdir()) == ["config.json", "thesis.txt"]
        with pytest.raises(FileExistsError, match="is a file"):
            write(work / "thesis.txt")
    (tmp_path / "empty").mkdir()
    export_gates(gates, tmp_path / "empty")
    (path / "notes.md").write_text("beside the gates")  # over the export: earlier gates, replaced whole
    gates.save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "gates.safetensors", "retention.json"]


def test_a_damaged_checkpoint_is_a_clear_error(checkpoint, tmp_path, capsys, monkeypatch):
    """A cut-off download or a hand-edited config used to end in a safetensors / JSON traceback."""
    import shutil

    import retention
    import retention.models
    from retention.cli import main
    from retention.gates import GateCheckpointError

    path, gates, _ = checkpoint
    cases = {
        "cut": lambda d: (d / "gates.safetensors").write_bytes((path / "gates.safetensors").read_bytes()[:500]),
        "json": lambda d: (d / "retention.json").write_text("{"),
        "no_config": lambda d: (d / "retention.json").write_text('{"format": "retention-gates/1"}'),
        "layout": lambda d: (d / "retention.json").write_text(json.dumps(other_width)),
    }
    other_width = json.loads((path / "retention.json").read_text())
    other_width["gate_config"]["gate_hidden"] += 4  # tensors of one width, a config of another
    for where in (retention.models, retention):
        monkeypatch.setattr(where, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    for name, damage in cases.items():
        broken = tmp_path / name
        shutil.copytree(path, broken)
        damage(broken)
        with pytest.raises(GateCheckpointError, match="re-export or re-download the checkpoint"):
            load_gates(broken)
        assert main(["chat", "--gates", str(broken)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("retention chat: error: ") and str(broken) in err, name


def flip_low_bytes(file: Path, n: int = 1000) -> None:
    """Change the lowest byte of ``n`` float32 values of a safetensors file in place: still finite, still loadable."""
    data = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # 8 bytes of header length, the JSON header, then the tensors
    for i in range(n):
        data[start + 4 * i] ^= 0x01
    file.write_bytes(bytes(data))


def test_gates_whose_tensors_changed_are_refused_unless_verify_is_off(checkpoint, tmp_path, capsys, monkeypatch):
    """Issue 77: 1,000 flipped bytes inside the tensors loaded without a word. The metadata records the tensors'
    SHA-256 (its first 12 digits the fingerprint); a load checks it, verify=False loads weights edited on purpose,
    and a checkpoint from before the hash loads as it did."""
    import shutil

    import retention
    import retention.models
    from retention.cli import main

    path, gates, _ = checkpoint
    recorded = json.loads((path / "retention.json").read_text())["gates_sha256"]
    assert len(recorded) == 64 and recorded[:12] == gates.fingerprint()
    saved = gates.save_pretrained(tmp_path / "saved")  # the other writer records it too
    assert json.loads((saved / "retention.json").read_text())["gates_sha256"] == recorded
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    flip_low_bytes(broken / "gates.safetensors")
    with pytest.raises(GateCheckpointError, match=r"broken/gates.safetensors is damaged: its tensors do not match the "
                                                  r"SHA-256 that retention.json records .*verify=False"):
        load_gates(broken)
    for where in (retention.models, retention):
        monkeypatch.setattr(where, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main(["chat", "--gates", str(broken)]) == 2
    assert "gates.safetensors is damaged" in capsys.readouterr().err
    edited = load_gates(broken, verify=False)
    assert edited.fingerprint() != gates.fingerprint()
    meta = json.loads((broken / "retention.json").read_text())
    del meta["gates_sha256"]  # a checkpoint written before the hash was recorded
    (broken / "retention.json").write_text(json.dumps(meta))
    assert load_gates(broken).fingerprint() == edited.fingerprint()


def test_the_shipped_checkpoints_record_the_hash_of_their_tensors():
    """The hash was added to their retention.json without touching gates.safetensors: the fingerprints that name
    their published rows are the same."""
    from retention.models import shipped_checkpoint

    for name, fingerprint in (("smollm2-135m-global", "b9f2ddc9e7b3"), ("smollm2-135m-trimkv", "a937e4c61da3"),
                              ("smollm2-135m-trimkv-4k", "e0a9f702343c")):
        folder = shipped_checkpoint(name)
        assert json.loads((folder / "retention.json").read_text())["gates_sha256"][:12] == fingerprint
        assert load_gates(folder).fingerprint() == fingerprint


def test_model_card_says_what_the_variant_is(tmp_path):
    model = tiny_llama()
    cards = {}
    for variant in ("global", "trimkv"):
        gates = RetentionGates(GateConfig.for_model(model, variant=variant))
        cards[variant] = (export_gates(gates, tmp_path / variant, base_model="tiny-llama") / "README.md").read_text()
    assert "global capacity loss" in cards["global"] and "tied" in cards["global"]
    assert "per-head capacity loss" in cards["trimkv"] and "global capacity loss" not in cards["trimkv"]


def test_a_card_of_gates_exported_without_a_summary_or_budget_renders(tmp_path):
    """export_gates(..., training=None) crashed in the card (None.items()), and no budget wrote "None" in its row."""
    gates = RetentionGates(GateConfig.for_model(tiny_llama(), variant="global"))
    card = (export_gates(gates, tmp_path / "g", base_model="tiny-llama", training=None, budget=None)
            / "README.md").read_text()
    assert "| training budget | n/a |" in card and "None" not in card


def test_load_round_trip_and_attach(checkpoint):
    path, gates, model = checkpoint
    loaded = load_gates(path, model=model)
    for k, v in gates.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    attach_gates(model, loaded)


@pytest.mark.parametrize("variant", ["global", "trimkv"])
def test_model_card_usage_snippet_runs(tmp_path, variant):
    """The card's "Use" block is what people copy: its imports and calls must work as written, and its
    cache uses the policy the variant was trained for."""
    model = tiny_llama()
    gates = RetentionGates(GateConfig.for_model(model, variant=variant, bias_init=2.0))
    path = export_gates(gates, tmp_path / "ckpt", base_model="tiny-llama")
    card = (path / "README.md").read_text()
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace('"<this repo or folder>"', repr(str(path)))
    model_line = next(line for line in code.splitlines() if "load_model(" in line)
    # the base model here is a tiny random one built in the test, not a Hub download
    code = code.replace(model_line, "")
    scope = {"model": model}
    exec(code, scope)
    attached = scope["gates"]
    assert all(torch.equal(attached.state_dict()[k], v) for k, v in gates.state_dict().items())
    assert scope["cache"].budget == 64 * model.config.num_hidden_layers * model.config.num_key_value_heads
    assert scope["cache"].policy.name == {"global": "global_gates", "trimkv": "trimkv"}[variant]


def test_load_refuses_gates_of_another_model(checkpoint):
    path, _, _ = checkpoint
    other = tiny_qwen3(num_hidden_layers=2)
    with pytest.raises(ValueError, match="gates do not match this model"):
        load_gates(path, model=other)


def test_a_checkpoint_under_home_loads_by_tilde(checkpoint, monkeypatch):
    path, gates, _ = checkpoint
    monkeypatch.setenv("HOME", str(Path(path).parent))
    assert load_gates(f"~/{Path(path).name}").config == load_gates(path).config
    # and is written there by "~/...": was a folder named "~" in the working directory
    assert export_gates(gates, "~/again") == Path(path).parent / "again"
    assert (gates.save_pretrained("~/plain") == Path(path).parent / "plain"
            and load_gates("~/plain").config == gates.config)


def test_a_checkpoint_file_names_its_checkpoint_and_a_run_folder_lists_the_ones_inside(checkpoint, tmp_path):
    """Giving the checkpoint's gates.safetensors (or its retention.json) looked for "gates.safetensors/config.json";
    a folder that holds checkpoints (a run's output, checkpoints/) said only that its config.json was missing."""
    path, gates, _ = checkpoint
    for name in ("gates.safetensors", "retention.json"):
        assert torch.equal(load_gates(path / name).state_dict()["W1"], gates.state_dict()["W1"])
    stray = tmp_path / "loose"  # a file of that name outside a checkpoint is not taken for one
    stray.mkdir()
    (stray / "retention.json").write_text("{}")
    with pytest.raises(GateCheckpointError, match="loose/retention.json/retention.json not found"):
        load_gates(stray / "retention.json")
    run = tmp_path / "run"
    export_gates(gates, run / "final", base_model="tiny-llama")
    step = run / "checkpoints" / "step-4"  # a training checkpoint: gates and trainer state, no retention.json
    step.mkdir(parents=True)
    for name in ("gates.safetensors", "state.json"):
        (step / name).write_bytes((run / "final" / "gates.safetensors").read_bytes() if name.endswith("tensors")
                                  else b"{}")
    with pytest.raises(GateCheckpointError,
                       match=r"run/retention.json not found: .*; the gate checkpoints under it: final$"):
        load_gates(run)
    with pytest.raises(GateCheckpointError, match=f"a training checkpoint: export its gates with `python train.py "
                                                  f"--config CONFIG --export {step}`"):
        load_gates(step)
    with pytest.raises(GateCheckpointError, match=r"gates.safetensors$"):  # no hint where there is none
        load_gates(stray)


def test_unreachable_repo_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="neither a local folder nor reachable"):
        load_gates("someone/does-not-exist-retention-gates")


def test_shipped_gates_load_by_name_from_any_folder(monkeypatch, tmp_path):
    """``load_gates("checkpoints/smollm2-135m-global")``, as the README had it, is a path into the checkout: run from
    another folder (or with the wheel installed) it went to the Hub. A shipped checkpoint's folder name, bare or
    under ``checkpoints/``, now finds the package's copy; other missing paths still go to the Hub."""
    from retention.hub import checkpoint_folder
    from retention.models import shipped_gates

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    shipped = shipped_gates("smollm2-135m")
    assert checkpoint_folder("checkpoints/smollm2-135m-global") == shipped
    assert checkpoint_folder("smollm2-135m-global") == shipped
    assert load_gates("smollm2-135m-global").config.variant == "global"
    for missing in ("checkpoints/not-shipped", "elsewhere/smollm2-135m-global"):  # could be Hub repos
        with pytest.raises(HubError, match="neither a local folder nor reachable"):
            checkpoint_folder(missing)
    for missing in ("a/checkpoints/smollm2-135m-global", "./gates", "~/gates", "/no/such/gates"):
        with pytest.raises(HubError, match="there is no such folder"):  # no Hub id: was the Hub's repo-id error
            checkpoint_folder(missing)
    (tmp_path / "smollm2-135m-global").mkdir()  # a folder of that name here wins, as any local path does
    assert checkpoint_folder("smollm2-135m-global") == Path("smollm2-135m-global")


class FakeHub:
    """An httpx transport standing in for the Hub: records requests, answers like the Hub API."""

    def __init__(self, status=200):
        self.requests = []
        self.status = status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if self.status is None:  # no network: the client's transport error, which is no OSError
            raise httpx.ConnectError("[Errno -2] Name or service not known", request=request)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": "denied"}, request=request)
        if path == "/api/repos/create":
            return httpx.Response(200, json={"url": "https://huggingface.co/me/gates", "name": "me/gates"},
                                  request=request)
        if path == "/api/validate-yaml":  # the model card's metadata is checked before the commit
            return httpx.Response(200, json={"errors": [], "warnings": []}, request=request)
        if path.endswith("/preupload/main"):
            files = json.loads(request.content)["files"]
            return httpx.Response(200, json={"files": [{"path": f["path"], "uploadMode": "regular",
                                                        "shouldIgnore": False} for f in files]}, request=request)
        if path.endswith("/commit/main"):
            return httpx.Response(200, json={"commitUrl": "https://huggingface.co/me/gates/commit/abc",
                                             "commitOid": "a" * 40}, request=request)
        return httpx.Response(404, json={"error": f"unexpected {request.method} {path}"}, request=request)

    def committed_files(self) -> dict[str, bytes]:
        (commit,) = [r for r in self.requests if r.url.path.endswith("/commit/main")]
        files = {}
        for line in commit.content.decode().splitlines():
            item = json.loads(line)
            if item["key"] == "file":
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
        return files


@pytest.fixture
def fake_hub(monkeypatch):
    from huggingface_hub.utils import _http

    def install(status=200):
        hub = FakeHub(status)
        _http.set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(hub)))
        _http.close_session()
        return hub

    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_tests")
    yield install
    _http.set_client_factory(_http.default_client_factory)
    _http.close_session()


def test_push_sends_exactly_the_checkpoint_files(checkpoint, fake_hub):
    path, _, _ = checkpoint
    (path / "notes.tmp").write_text("not part of the checkpoint")
    hub = fake_hub()
    url = push_to_hub(path, "me/gates")
    assert url == "https://huggingface.co/me/gates/commit/abc"
    sent = hub.committed_files()
    assert sorted(sent) == ["README.md", "gates.safetensors", "retention.json"]
    for name, data in sent.items():
        assert data == (path / name).read_bytes()
    assert all(r.headers["authorization"] == "Bearer hf_fake_token_for_tests" for r in hub.requests)


def test_push_sends_the_images_the_model_card_shows(checkpoint, fake_hub):
    from retention.hub import card_figures

    path, _, _ = checkpoint
    (path / "README.md").write_text((path / "README.md").read_text()
                                    + "\n![plot](results.png)\n![gaps](results-goal.png)"
                                    "\n![badge](https://img.shields.io/x.svg)\n")
    (path / "results.png").write_bytes(b"png one")
    (path / "other.png").write_bytes(b"shown nowhere")
    with pytest.raises(HubError, match=r"shows \['results-goal.png'\], which the folder lacks"):  # before any request
        push_to_hub(path, "me/gates")
    (path / "results-goal.png").write_bytes(b"png two")
    assert card_figures(path) == ["results.png", "results-goal.png"]
    hub = fake_hub()
    push_to_hub(path, "me/gates")
    sent = hub.committed_files()
    assert sorted(sent) == ["README.md", "gates.safetensors", "results-goal.png", "results.png", "retention.json"]
    assert sent["results-goal.png"] == b"png two"


def test_push_unauthorised_is_a_clear_error(checkpoint, fake_hub):
    path, _, _ = checkpoint
    fake_hub(status=401)
    with pytest.raises(HubError, match="HTTP 401.*HF_TOKEN"):
        push_to_hub(path, "me/gates")


def test_a_server_failure_or_no_network_is_a_clear_error_that_says_what_to_do(checkpoint, fake_hub, tmp_path):
    """A dropped connection was an httpx ConnectError traceback (huggingface_hub 2.x's client raises no OSError), an
    HTTP 500 was blamed on the repo id, and the Hub's own reason was dropped."""
    path, _, _ = checkpoint
    fake_hub(status=500)
    with pytest.raises(HubError, match=r"HTTP 500: denied\): the Hub failed: try again later"):
        push_to_hub(path, "me/gates")
    fake_hub(status=403)
    with pytest.raises(HubError, match=r"HTTP 403: denied\): set HF_TOKEN to a token with write access to 'me'"):
        push_to_hub(path, "me/gates")
    fake_hub(status=None)
    with pytest.raises(HubError, match=f"cannot reach the Hub .*Name or service not known.*retention push {path} "
                                       "me/gates"):
        push_to_hub(path, "me/gates")
    (tmp_path / "step-2").mkdir()  # a run's checkpoint: the message names the export that makes it pushable
    for name in ("gates.safetensors", "state.json"):
        (tmp_path / "step-2" / name).write_text("{}")
    with pytest.raises(HubError, match="python train.py --config CONFIG --export .*step-2 --to DIR, then push DIR"):
        push_to_hub(tmp_path / "step-2", "me/gates")


def test_push_without_a_token_or_with_a_bad_repo_id_sends_nothing(checkpoint, fake_hub, monkeypatch, tmp_path):
    path, _, _ = checkpoint
    hub = fake_hub()
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored login
    with pytest.raises(HubError, match="needs a Hub token: set HF_TOKEN"):
        push_to_hub(path, "me/gates")
    with pytest.raises(HubError, match="cannot upload to 'me/gates/extra'.*owner/name"):
        push_to_hub(path, "me/gates/extra", token="hf_x")
    assert hub.requests == []


def test_push_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(HubError, match="missing \\['gates.safetensors'"):
        push_to_hub(tmp_path, "me/gates")


def test_push_names_a_missing_folder_and_finds_the_shipped_checkpoint_by_name(fake_hub, monkeypatch, tmp_path):
    """`retention push smollm2-135m-global REPO` said the folder was "not a gate checkpoint: missing [...]" from any
    folder but the checkout's checkpoints/: the shipped name now finds the package's copy, as load_gates does, and a
    path that does not exist is named as such."""
    from retention.models import shipped_gates

    monkeypatch.chdir(tmp_path)
    with pytest.raises(HubError, match="no-such-gates: there is no such folder"):
        push_to_hub("no-such-gates", "me/gates")
    hub = fake_hub()
    push_to_hub("smollm2-135m-global", "me/gates")
    sent = hub.committed_files()
    shipped = shipped_gates("smollm2-135m")
    assert sent["gates.safetensors"] == (shipped / "gates.safetensors").read_bytes()
    assert {"README.md", "retention.json"} <= set(sent)


def _with_bad_values(src: Path, dest: Path, **values: float) -> Path:
    """A copy of the checkpoint ``src`` at ``dest`` whose tensors named in ``values`` have their first value set, as
    a run wrote them before the hash of the tensors was recorded (no ``gates_sha256``: a changed tensor is damage)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    state = load_file(dest / "gates.safetensors")
    for name, value in values.items():
        state[name].view(-1)[0] = value
    save_file(state, dest / "gates.safetensors", metadata={"format": "pt"})
    meta = json.loads((dest / "retention.json").read_text())
    meta.pop("gates_sha256", None)
    (dest / "retention.json").write_text(json.dumps(meta))
    return dest


def test_a_checkpoint_with_nan_or_inf_weights_is_refused(tmp_path):
    """A diverged run exported all-NaN gates and load_gates returned them without a word (every score NaN)."""
    from retention.gates import RetentionGates
    from retention.models import shipped_checkpoint

    shipped = shipped_checkpoint("smollm2-135m-trimkv")
    bad = _with_bad_values(shipped, tmp_path / "diverged", W1=float("nan"), b=float("inf"))
    for load in (load_gates, RetentionGates.from_pretrained):  # what `retention average` and the chat read
        with pytest.raises(GateCheckpointError) as e:
            load(bad)
        msg = str(e.value)
        assert str(bad) in msg and "W1 (1 of" in msg and "b (1 of" in msg and "b1" not in msg
        assert "diverged" in msg and "train.lr" in msg and "--export RUN/checkpoints/step-N" in msg
    assert load_gates(shipped).config.variant == "trimkv"  # finite gates load as before


def test_gates_with_nan_or_inf_weights_are_never_written_over_a_checkpoint(checkpoint):
    """export_gates and save_pretrained wrote NaN gates (a diverged run's, handed to the API) over the good checkpoint
    at that path: the write succeeded and the folder then held gates that every load refuses."""
    path, gates, _ = checkpoint
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    bad = RetentionGates(gates.config)
    bad.load_state_dict(gates.state_dict())
    with torch.no_grad():
        bad.W1.view(-1)[0] = float("nan")
        bad.b.fill_(float("inf"))
    for write in (lambda p: export_gates(bad, p, base_model="tiny-llama"), bad.save_pretrained):
        with pytest.raises(ValueError, match=r"hold NaN or inf \(W1 \(1 of \d+ values\), b \(1 of 1 values\)\)"):
            write(path)
        assert {f.name: f.read_bytes() for f in path.iterdir()} == before
        assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]  # no temp folder either
    assert load_gates(path).fingerprint() == gates.fingerprint()


def test_push_sends_images_linked_with_a_dot_path_a_title_or_a_bracket_in_their_name(checkpoint, fake_hub):
    """Links the card renders but push missed: ./a.png passed the check that the file is there, then matched no
    upload pattern ("a.png" does not match "./a.png"); ![d](d.png "title") was no figure at all; a name with
    brackets is a glob class to the upload's patterns. Each was left out while push reported success."""
    from retention.hub import card_figures

    path, _, _ = checkpoint
    (path / "README.md").write_text((path / "README.md").read_text() + '\n![a](./a.png)\n![b](figs/./b.png)'
                                    '\n![d](d.png "the title")\n![e](e[1].png)\n![up](../up.png)\n')
    for name in ("a.png", "figs/b.png", "d.png", "e[1].png", "e1.png"):
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_bytes(name.encode())
    (path.parent / "up.png").write_bytes(b"outside the checkpoint")
    assert card_figures(path) == ["a.png", "figs/b.png", "d.png", "e[1].png"]
    hub = fake_hub()
    push_to_hub(path, "me/gates")
    sent = hub.committed_files()
    assert sorted(sent) == ["README.md", "a.png", "d.png", "e[1].png", "figs/b.png", "gates.safetensors",
                            "retention.json"]
    assert all(sent[name] == name.encode() for name in ("a.png", "figs/b.png", "d.png", "e[1].png"))


def _legacy(path: Path, tmp_path: Path) -> Path:
    """The checkpoint at ``path`` as checkpoints before retention.json were written: its metadata and the card's
    results in config.json, the card made from that file."""
    import shutil

    from retention.hub import model_card

    old = tmp_path / "legacy"
    shutil.copytree(path, old)
    meta = json.loads((old / "retention.json").read_text())
    (old / "retention.json").unlink()
    meta.update(results_markdown="| method | score |\n|---|---|\n| gates | 90 |",
                results_sections=[{"title": "Goal check", "markdown": "| a | b |\n|---|---|\n| 1 | 2 |"}])
    (old / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    (old / "README.md").write_text(model_card(meta))
    return old


def test_a_checkpoint_from_before_retention_json_loads_pushes_and_converts(checkpoint, tmp_path, fake_hub):
    from retention.gates import is_gate_folder
    from retention.hub import card_results, local_checkpoint, model_card
    from retention.metadata import read_metadata, write_metadata

    path, gates, model = checkpoint
    old = _legacy(path, tmp_path)
    assert is_gate_folder(old) and local_checkpoint(old / "config.json") == old
    loaded = load_gates(old, model=model)
    assert loaded.fingerprint() == gates.fingerprint() and loaded.config.base_model == "tiny-llama"
    meta = read_metadata(old)
    assert meta["budget"] == "64 entries" and "results_markdown" not in meta  # results belong to the card
    assert card_results(old) == ("| method | score |\n|---|---|\n| gates | 90 |",
                                 [{"title": "Goal check", "markdown": "| a | b |\n|---|---|\n| 1 | 2 |"}])
    hub = fake_hub()
    push_to_hub(old, "me/gates")
    assert sorted(hub.committed_files()) == ["README.md", "config.json", "gates.safetensors"]
    # rewriting its metadata converts it: retention.json replaces config.json, the results stay in the card
    card = (old / "README.md").read_text()
    write_metadata(old, meta)
    assert sorted(p.name for p in old.iterdir()) == ["README.md", "gates.safetensors", "retention.json"]
    assert load_gates(old).fingerprint() == gates.fingerprint()
    main, sections = card_results(old)  # now read from the card
    assert model_card(read_metadata(old), main, sections) == card


def test_a_model_folders_config_json_is_no_gate_metadata(tmp_path):
    from retention.metadata import metadata_file

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert metadata_file(tmp_path) == tmp_path / "retention.json"  # missing: not the model's config
    with pytest.raises(GateCheckpointError, match="retention.json not found"):
        load_gates(tmp_path)


@pytest.mark.parametrize("name", ["smollm2-135m-global", "smollm2-135m-trimkv", "smollm2-135m-trimkv-4k"])
def test_the_shipped_cards_results_read_back_as_they_are_shown(name):
    """Publishing into a shipped checkpoint rebuilds its card from retention.json and the results read from the card:
    they must come back as the card shows them (the tables are no longer kept in a second file)."""
    from retention.hub import card_results, model_card
    from retention.metadata import read_metadata

    folder = Path(__file__).resolve().parent.parent / "checkpoints" / name
    assert not (folder / "config.json").exists() and (folder / "retention.json").is_file()
    card = (folder / "README.md").read_text()
    remade = model_card(read_metadata(folder), *card_results(folder))
    results = card.index("\n## Results\n") if "\n## Results\n" in card else len(card)
    assert remade[remade.find("\n## Results\n") if "\n## Results\n" in remade else len(remade):] == card[results:]
    assert remade.split("---\n", 2)[1] == card.split("---\n", 2)[1]  # the Hub metadata, as export_gates writes it
    assert len((folder / "retention.json").read_bytes()) < 4000  # metadata, not tables


# -- Hub and PEFT conventions (issue 76) ----------------------------------------------------------------------------

def test_save_pretrained_writes_the_export_format_and_from_pretrained_reads_it_back(checkpoint, tmp_path):
    """save_pretrained wrote a second layout (no model card, no format key): it is now the one writer, export_gates
    included, and what it writes loads back as the same tensors and config."""
    _, gates, _ = checkpoint
    info = dict(base_model="someone/tiny-llama", budget="64 entries", training={"steps": 3})
    saved = gates.save_pretrained(tmp_path / "saved", **info)
    exported = export_gates(gates, tmp_path / "exported", **info)
    files = sorted(p.name for p in saved.iterdir())
    assert files == ["README.md", "gates.safetensors", "retention.json"]
    assert all((saved / f).read_bytes() == (exported / f).read_bytes() for f in files)
    meta = json.loads((saved / "retention.json").read_text())
    assert meta["format"] == "retention-gates/1" and len(meta["gates_sha256"]) == 64
    loaded = RetentionGates.from_pretrained(saved)
    assert loaded.config == GateConfig(**{**gates.config.to_dict(), "base_model": "someone/tiny-llama"})
    assert loaded.state_dict().keys() == gates.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in gates.state_dict().items())
    plain = RetentionGates.from_pretrained(gates.save_pretrained(tmp_path / "plain"))  # no metadata: the same config
    assert plain.config == gates.config and plain.fingerprint() == gates.fingerprint()


def test_from_pretrained_downloads_a_hub_id_at_a_revision_with_a_token(checkpoint, monkeypatch):
    """A Hub id goes through snapshot_download (only the checkpoint's files), as load_gates goes; revision and token
    reach it, as PEFT's from_pretrained passes them."""
    import huggingface_hub

    path, gates, model = checkpoint
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = RetentionGates.from_pretrained("someone/tiny-gates", revision="v1", token="hf_private")
    assert loaded.fingerprint() == gates.fingerprint()
    assert load_gates("someone/tiny-gates", model=model, revision="v2", token="hf_other").config == loaded.config
    assert [(r, k["revision"], k["token"]) for r, k in calls] == [("someone/tiny-gates", "v1", "hf_private"),
                                                                   ("someone/tiny-gates", "v2", "hf_other")]
    assert all(sorted(k["allow_patterns"]) == ["README.md", "config.json", "gates.safetensors", "retention.json"]
               for _, k in calls)


def test_gates_push_to_hub_uploads_what_save_pretrained_writes(checkpoint, fake_hub, tmp_path, monkeypatch):
    _, gates, _ = checkpoint
    hub = fake_hub()
    url = gates.push_to_hub("me/gates", base_model="someone/tiny-llama", budget="64 entries")
    assert url == "https://huggingface.co/me/gates/commit/abc"
    sent = hub.committed_files()
    saved = gates.save_pretrained(tmp_path / "same", base_model="someone/tiny-llama", budget="64 entries")
    assert sorted(sent) == ["README.md", "gates.safetensors", "retention.json"]
    assert all(sent[f] == (saved / f).read_bytes() for f in sent)
    hub = fake_hub()
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored login
    with pytest.raises(HubError, match="needs a Hub token"):
        gates.push_to_hub("me/gates", base_model="someone/tiny-llama")
    assert hub.requests == []


def _front_matter(card: str) -> dict:
    import yaml

    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n", 2)[1])


def test_the_model_card_front_matter_is_hub_metadata(tmp_path):
    """The card's YAML (parsed as the Hub parses it) names the base as an adapter's, the pipeline, the Hub datasets."""
    from tiny_models import tiny_qwen3_vl

    gates = RetentionGates(GateConfig.for_model(tiny_llama()))
    card = (export_gates(gates, tmp_path / "text", base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                         datasets=["HuggingFaceFW/fineweb-edu", "HuggingFaceFW/fineweb-edu", "./local.jsonl"])
            / "README.md").read_text()
    assert _front_matter(card) == {
        "library_name": "retention", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "base_model_relation": "adapter", "pipeline_tag": "text-generation", "datasets": ["HuggingFaceFW/fineweb-edu"],
        "tags": ["kv-cache", "kv-cache-eviction", "retention-gates"], "license": "apache-2.0"}
    vl = RetentionGates(GateConfig.for_model(tiny_qwen3_vl()))
    assert vl.config.base_model_type == "qwen3_vl"
    front = _front_matter((export_gates(vl, tmp_path / "vl", base_model="Qwen/Qwen3-VL-2B-Instruct", datasets=[])
                           / "README.md").read_text())
    assert front["pipeline_tag"] == "image-text-to-text" and "datasets" not in front  # none: no key


def test_a_local_base_model_is_left_out_of_the_card_and_refused_by_push(tmp_path, fake_hub):
    """Gates trained from a local copy named its folder as base_model: the Hub would link a repo that does not exist.
    The card leaves it out, and push says which key to fix and how."""
    from retention.hub import model_card

    gates = RetentionGates(GateConfig.for_model(tiny_llama()))
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    for base in ("/home/me/models/SmolLM2-135M-Instruct", "./models/tiny", str(tmp_path / "models" / "tiny")):
        path = export_gates(gates, tmp_path / "g", base_model=base)
        card = (path / "README.md").read_text()
        front = _front_matter(card)
        assert "base_model" not in front and "base_model_relation" not in front and base not in card
        hub = fake_hub()
        with pytest.raises(HubError, match=r"base_model is the local path .*not a Hub id.*base_model= the base "
                                           r"model's Hub id"):
            push_to_hub(path, "me/gates")
        with pytest.raises(HubError, match="base_model is the local path"):
            gates.push_to_hub("me/gates", base_model=base)
        assert hub.requests == []
    meta = {"gate_config": gates.config.to_dict()}  # no base model recorded at all
    assert "base_model" not in _front_matter(model_card({**meta, "base_model": None}))


def test_push_with_base_model_names_the_hub_id_in_the_checkpoint_first(tmp_path, fake_hub, capsys):
    """The fix push names: `retention push DIR REPO --base-model owner/name` (push_to_hub(..., base_model=)) records
    the Hub id in retention.json and rebuilds the card, results kept, then uploads."""
    from retention.cli import main
    from retention.hub import card_results

    gates = RetentionGates(GateConfig.for_model(tiny_llama()))
    path = export_gates(gates, tmp_path / "g", base_model="/home/me/models/SmolLM2-135M-Instruct", budget="64")
    card = (path / "README.md").read_text() + "## Results\n\n| method | score |\n|---|---|\n| gates | 90 |\n"
    (path / "README.md").write_text(card)
    hub = fake_hub()
    assert main(["push", str(path), "me/gates", "--base-model", "not/a/hub/id"]) == 2
    assert "not a Hub model id" in capsys.readouterr().err and hub.requests == []
    assert main(["push", str(path), "me/gates", "--base-model", "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 0
    sent = hub.committed_files()
    meta = json.loads(sent["retention.json"])
    assert meta["base_model"] == meta["gate_config"]["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert _front_matter(sent["README.md"].decode())["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert sent["README.md"] == (path / "README.md").read_bytes()  # the folder says what the Hub has
    assert card_results(path)[0] == "| method | score |\n|---|---|\n| gates | 90 |"
    assert load_gates(path).fingerprint() == gates.fingerprint()
