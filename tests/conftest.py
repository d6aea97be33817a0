import sys
from pathlib import Path

# tests import their shared builders (tiny_models, tiny_vl) as top-level modules
sys.path.insert(0, str(Path(__file__).parent))
