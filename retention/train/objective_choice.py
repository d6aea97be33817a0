"""The objective class a config's ``loss.objective`` names. Apart from :mod:`.objectives` (the interface that each
objective's module imports), so that choosing one closes no import cycle."""

from __future__ import annotations

from .config import Config
from .objectives import Objective


def objective_class(cfg: Config) -> type[Objective]:
    """The class of the configured ``loss.objective``."""
    if cfg.loss.objective == "evict":
        from .evict import EvictObjective

        return EvictObjective
    from .distill import DistillObjective

    return DistillObjective
