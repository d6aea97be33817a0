"""The import graph of ``retention/`` has no cycles and follows the layering of docs/layers.md.

The graph is read statically from the source (``ast``), with every import: at module level, inside functions
(a "lazy" import is still a dependency) and under ``TYPE_CHECKING``. An edge ``a -> b`` means module ``a`` imports
module ``b`` (``from retention.x import name`` is an edge to ``retention.x``, or to ``retention.x.name`` when that is
a module); a package's own ``__init__`` imported by its submodules is not an edge (Python runs it first anyway).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "retention"

# Bottom-up. A module may import modules of its own group and of lower layers only; groups that share a layer
# (gates and losses, train and eval, ...) never import each other. A module belongs to the group with the longest
# matching prefix.
LAYERS: list[dict[str, tuple[str, ...]]] = [
    {"base": ("retention.compat", "retention.log", "retention.io", "retention.images", "retention.templates",
              "retention.architecture", "retention.padding", "retention.locate", "retention.metadata",
              "retention.card", "retention.upload", "retention.budget")},
    {"ops": ("retention.ops",)},
    # the cache's page storage: policies read entries through its PaddedView, the cache builds on it
    {"kv storage": ("retention.cache.pool", "retention.cache.paged", "retention.cache.select")},
    {"gates": ("retention.gates",), "losses": ("retention.losses",)},
    {"attach": ("retention.attach",)},
    {"policies": ("retention.policies",)},
    {"cache": ("retention.cache",)},
    {"hub": ("retention.hub",), "models": ("retention.models",)},
    {"chat": ("retention.chat",)},
    {"tasks": ("retention.tasks",), "commands": ("retention.commands",)},
    {"train": ("retention.train",), "eval": ("retention.eval",), "retention_map": ("retention.retention_map",),
     "tiny_model": ("retention.tiny_model",)},
    {"cli": ("retention.cli", "retention.__main__"), "chat_cli": ("retention.chat_cli",),
     "average": ("retention.average",)},
    {"package": ("retention",)},  # the package's own __init__ only, not its modules
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__.py``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports anywhere in its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, set(known)) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def place(name: str) -> tuple[int, str]:
    """``(layer index, group)`` of a module: the group whose prefix matches it longest (``retention`` matches the
    package's ``__init__`` alone)."""
    best = None
    for i, layer in enumerate(LAYERS):
        for group, prefixes in layer.items():
            for prefix in prefixes:
                if name == prefix or (prefix != "retention" and name.startswith(prefix + ".")):
                    if best is None or len(prefix) > best[0]:
                        best = (len(prefix), i, group)
    if best is None:
        raise KeyError(f"{name} is in no layer of tests/test_layers.py: add it to LAYERS (and docs/layers.md)")
    return best[1], best[2]


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Each edge that goes up a layer or across to another group of the same layer, as ``a -> b (why)``."""
    out = []
    for a in sorted(edges):
        la, ga = place(a)
        for b in sorted(edges[a]):
            lb, gb = place(b)
            if lb > la:
                out.append(f"{a} -> {b} (layer {ga!r} imports the higher layer {gb!r})")
            elif lb == la and ga != gb:
                out.append(f"{a} -> {b} ({ga!r} and {gb!r} share a layer and never import each other)")
    return out


def test_the_retention_package_has_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles in retention/:\n" + "\n".join(" -> ".join(c) for c in found)


def test_every_import_follows_the_layers():
    bad = layer_violations(graph())
    assert not bad, "imports against the layering of docs/layers.md:\n" + "\n".join(bad)


def test_every_module_has_a_layer():
    unplaced = []
    for name in modules():
        try:
            place(name)
        except KeyError:
            unplaced.append(name)
    assert not unplaced


# The checks themselves, on a package written for them: each must catch what it is there to catch.

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "retention"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_lazy_import_inside_a_function_closes_a_cycle(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "gates.py": "def f():\n    from .attach import x\n",
        "attach.py": "from retention.gates import f\n",
    })
    edges = graph(root)
    assert edges["retention.gates"] == {"retention.attach"}
    assert cycles(edges) == [["retention.attach", "retention.gates"]]


def test_a_type_checking_import_counts_and_a_package_init_does_not(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from .cache import hf\n",
        "cache/__init__.py": "from .hf import C\n",
        "cache/hf.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..policies import P\n",
        "policies/__init__.py": "from . import base\n",
        "policies/base.py": "from retention import cache\n",
    })
    edges = graph(root)
    assert edges["retention.cache.hf"] == {"retention.policies"}
    assert edges["retention.policies.base"] == {"retention.cache"}
    assert cycles(edges) == [["retention.cache", "retention.cache.hf", "retention.policies",
                              "retention.policies.base"]]


@pytest.mark.parametrize("edge, why", [
    (("retention.gates", "retention.hub"), "layer 'gates' imports the higher layer 'hub'"),
    (("retention.attach", "retention.cache.hf"), "layer 'attach' imports the higher layer 'cache'"),
    (("retention.train.evict", "retention.eval.protocol"), "'train' and 'eval' share a layer"),
    (("retention.eval.runner", "retention.cli"), "layer 'eval' imports the higher layer 'cli'"),
])
def test_an_import_up_or_across_the_layers_is_named(edge, why):
    a, b = edge
    bad = layer_violations({a: {b}, b: set()})
    assert len(bad) == 1 and bad[0].startswith(f"{a} -> {b} (") and why in bad[0]


def test_a_module_in_no_layer_is_named():
    with pytest.raises(KeyError, match="retention.newcomer is in no layer"):
        place("retention.newcomer")


def test_imports_down_the_layers_pass():
    edges = {"retention.cli": {"retention.train", "retention.eval.runner"},
             "retention.train.loop": {"retention.tasks", "retention.commands", "retention.train.data"},
             "retention.policies.base": {"retention.cache.paged"}, "retention.cache.hf": {"retention.policies"}}
    assert layer_violations(edges) == []
