"""The project's style rules that a machine can check: every public function of the library has type hints."""

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "retention"


def unannotated(tree: ast.Module) -> list[str]:
    """``"name:line"`` of each public function or public class's method with a parameter or return unannotated
    (``self`` / ``cls`` and ``__init__``'s return excepted; private names, starting with ``_``, are not checked)."""
    found = []

    def visit(node: ast.AST, prefix: str, in_class: bool) -> None:
        for n in ast.iter_child_nodes(node):
            if isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
                visit(n, f"{prefix}{n.name}.", True)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if n.name.startswith("_") and n.name not in ("__init__", "__call__"):
                    continue
                args = n.args.posonlyargs + n.args.args + n.args.kwonlyargs
                if in_class and args and args[0].arg in ("self", "cls"):
                    args = args[1:]
                args += [a for a in (n.args.vararg, n.args.kwarg) if a is not None]
                if any(a.annotation is None for a in args) or (n.returns is None and n.name != "__init__"):
                    found.append(f"{prefix}{n.name}:{n.lineno}")

    visit(tree, "", False)
    return found


def test_the_checker_finds_a_missing_hint():
    tree = ast.parse("def f(x: int) -> int: ...\n"
                     "def g(x) -> int: ...\n"
                     "def h(x: int): ...\n"
                     "def _private(x): ...\n"
                     "class C:\n"
                     "    def __init__(self, n: int): ...\n"
                     "    def m(self, *args, **kw: int) -> None: ...\n")
    assert unannotated(tree) == ["g:2", "h:3", "C.m:7"]


def test_every_public_function_of_the_library_has_type_hints():
    missing = [f"{p.relative_to(LIBRARY.parent)}: {name}" for p in sorted(LIBRARY.rglob("*.py"))
               for name in unannotated(ast.parse(p.read_text()))]
    assert not missing, "public functions without type hints (annotate every parameter and the return):\n" + \
        "\n".join(missing)
