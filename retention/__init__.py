"""retention: learned retention gates for global KV-cache eviction in frozen LLMs."""

from . import log as _log  # noqa: F401  (the "retention" logger's handler, before any module logs)
from .attach import RetentionAttachment, UnsupportedModelError, attach_gates, SUPPORTED_MODEL_TYPES
from .gates import GateConfig, RetentionGates
from .hub import export_gates, load_gates, push_to_hub
from .models import DEFAULT_MODEL, load_model
from .ops.retention_attention import retention_attention

__version__ = "0.1.0"

# inference classes, imported on first use: they bring in transformers, which `import retention` alone does not
_LAZY = {"RetentionCache": "retention.cache", "GraphDecoder": "retention.cache", "RetentionChat": "retention.chat",
         "get_policy": "retention.policies", "GlobalGatesPolicy": "retention.policies"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'retention' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])

__all__ = [
    "DEFAULT_MODEL",
    "GateConfig",
    "GlobalGatesPolicy",
    "GraphDecoder",
    "RetentionAttachment",
    "RetentionCache",
    "RetentionChat",
    "RetentionGates",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "attach_gates",
    "export_gates",
    "get_policy",
    "load_gates",
    "load_model",
    "push_to_hub",
    "retention_attention",
]
