"""The project's style rules that a machine can check: every public function of the library has type hints, and no
line of the repository's Python files is longer than 120 characters."""

import ast
import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "retention"
MAX_LINE = 120  # pyproject.toml's [tool.ruff] line-length
# folders the fallback glob (no git, or not a checkout) skips: environments, build output, training runs
NOT_SOURCE = {".venv", "venv", ".git", "build", "dist", "runs", "outputs", "__pycache__", ".pytest_cache",
              ".hypothesis"}


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


def python_files(root: Path = REPO) -> list[Path]:
    """The ``.py`` files git tracks under ``root``; without git or a checkout (an unpacked sdist), every ``.py`` file
    under it outside :data:`NOT_SOURCE` folders and ``*.egg-info``."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=root, capture_output=True, text=True,
                                timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    tracked = sorted(root / p for p in listed.split("\0") if p and (root / p).is_file())
    if tracked:
        return tracked
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in NOT_SOURCE and not d.endswith(".egg-info")]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def long_lines(text: str, limit: int = MAX_LINE) -> list[tuple[int, int]]:
    """``(line number, length)`` of each line of ``text`` longer than ``limit`` characters (line ends not counted)."""
    lengths = (len(line.rstrip("\r")) for line in text.split("\n"))
    return [(n, length) for n, length in enumerate(lengths, 1) if length > limit]


def test_the_line_checker_finds_a_long_line(tmp_path):
    assert long_lines("short\n" + "x" * 121 + "\n" + "y" * 120 + "\r\n" + "z" * 200) == [(2, 121), (4, 200)]
    for rel in ("a.py", "pkg/b.py", ".venv/lib/c.py", "build/lib/d.py", "runs/e.py", "x.egg-info/f.py", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    # tmp_path is no checkout (or its files are untracked): the glob, without environments and build output
    assert [p.relative_to(tmp_path).as_posix() for p in python_files(tmp_path)] == ["a.py", "pkg/b.py"]


def test_no_line_of_a_python_file_is_longer_than_120_characters():
    files = python_files()
    assert LIBRARY / "__init__.py" in files and Path(__file__).resolve() in files
    too_long = [f"{p.relative_to(REPO).as_posix()}:{n} ({length})" for p in files
                for n, length in long_lines(p.read_text(encoding="utf-8"))]
    assert not too_long, (f"lines over {MAX_LINE} characters (wrap them inside brackets; split a long string into "
                          "adjacent literals):\n" + "\n".join(too_long))


def test_the_line_limit_is_the_one_pyproject_declares():
    ruff = re.search(r"^\[tool\.ruff\]\s*$(.*?)(?=^\[|\Z)", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    assert ruff and re.search(rf"^line-length\s*=\s*{MAX_LINE}\s*(#.*)?$", ruff.group(1), re.M)
