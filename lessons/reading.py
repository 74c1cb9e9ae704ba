"""
The code a stage teaches, printed before the stage runs it: file, line, name and source.

    show_code(console, PrefixCachingAllocator.touch)

prints "Read: allocator/prefix_caching.py:LINE  PrefixCachingAllocator.touch  (section 3. The
allocator)", LINE being where the method starts today, and the method's source with its line
numbers, so what a stage explains is on screen next to the state it draws, and easy to find
in the file afterwards.

Code an exercise asks for is held back: show_exercise prints the exercise's starter instead
(its signature, its rule and the TODO, or the student's code once written) and says where the
reference is, to read once the exercise's tests pass.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax

ROOT = Path(__file__).resolve().parents[1]


def section_of(path: Path, line: int) -> str | None:
    """The `# N. Title` section heading above `line` in a reference file, if it has one.

    >>> from allocator import prefix_caching
    >>> line = inspect.getsourcelines(prefix_caching.PrefixCachingAllocator.touch)[1]
    >>> section_of(Path(prefix_caching.__file__), line)
    '3. The allocator'
    """
    heading = None
    for number, text in enumerate(path.read_text().splitlines()[:line], 1):
        match = re.match(r"# (\d+\. .+)", text)
        if match:
            heading = match.group(1)
    return heading


def where(obj) -> str:
    """'package/file.py:line  qualified name (section)' for a function, method or class: the
    path from the top of the repository (a file outside it, by its name)."""
    path = Path(inspect.getsourcefile(obj)).resolve()
    _, line = inspect.getsourcelines(obj)
    section = section_of(path, line)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return f"{shown}:{line}  {obj.__qualname__}" + (f"  (section {section})" if section else "")


def show_code(console: Console, *objects) -> None:
    """Print where() each object lives, then its source with the file's line numbers."""
    for obj in objects:
        lines, start = inspect.getsourcelines(obj)
        console.print(f"[bold]Read: {where(obj)}[/]")
        console.print(Syntax("".join(lines), "python", line_numbers=True, start_line=start, word_wrap=True))


def show_exercise(console: Console, number: int, path: str, qualname: str, reference) -> None:
    """Print `qualname` ("function" or "Class.method") as the starter file `path` has it,
    where a stage would print `reference`: the student writes it in exercise `number` first.

    The starter is read as text, not imported: a half-written exercise never stops a stage.
    """
    file = Path(__file__).resolve().parents[1] / path
    text = file.read_text()
    try:
        node = definition(ast.parse(text), qualname)
    except SyntaxError as err:
        console.print(f"[bold]Exercise {number}: {path} does not parse yet ({err.msg}, line {err.lineno})[/]")
        return
    lines = text.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno]
    console.print(f"[bold]Exercise {number}: {path}:{node.lineno}  {qualname}[/]  (you write this)")
    console.print(Syntax("".join(lines), "python", line_numbers=True, start_line=node.lineno, word_wrap=True))
    console.print(f"The reference, {where(reference)}, is not printed: read it once exercise {number}'s "
                  f"tests pass (exercises/README.md).")


def definition(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    """The def of "function" or "Class.method" in a parsed module.

    >>> definition(ast.parse("class A:\\n    def f(self): pass"), "A.f").name
    'f'
    """
    scope = tree
    for name in qualname.split("."):
        scope = next(node for node in scope.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))
                     and node.name == name)
    return scope
