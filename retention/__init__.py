"""retention: learned retention gates for global KV-cache eviction in frozen LLMs."""

from .attach import RetentionAttachment, UnsupportedModelError, attach_gates, SUPPORTED_MODEL_TYPES
from .gates import GateConfig, RetentionGates
from .hub import export_gates, load_gates, push_to_hub
from .models import DEFAULT_MODEL, load_model
from .ops.retention_attention import retention_attention

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "GateConfig",
    "RetentionAttachment",
    "RetentionGates",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "attach_gates",
    "export_gates",
    "load_gates",
    "load_model",
    "push_to_hub",
    "retention_attention",
]
