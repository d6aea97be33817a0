import sys
from pathlib import Path

# tests import their shared builders (tiny_models, tiny_vl) as top-level modules
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """accelerate keeps one AcceleratorState per process: a test that trains in another precision must not meet the
    state an earlier test left (ValueError: already initialized), whatever order the files run in."""
    yield
    mod = sys.modules.get("accelerate.state")
    if mod is not None and mod.AcceleratorState._shared_state:
        mod.AcceleratorState._reset_state()


@pytest.fixture(scope="session")
def tok():
    """The embedded SmolLM2's tokenizer, for the task generators' tests (skipped where the model is not installed)."""
    from transformers import AutoTokenizer

    from retention.models import ModelNotAvailableError, embedded_model_dir

    try:
        return AutoTokenizer.from_pretrained(embedded_model_dir(progress=False))
    except ModelNotAvailableError as e:
        pytest.skip(str(e))
