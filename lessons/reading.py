"""
The code a stage teaches, printed before the stage runs it: file, line, name and source.

    show_code(console, PrefixCachingAllocator.touch)

prints "Read: prefix_caching.py:512  PrefixCachingAllocator.touch  (section 3. The
allocator)" and the method's source with its line numbers, so what a stage explains is on
screen next to the state it draws, and easy to find in the file afterwards.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax


def section_of(path: Path, line: int) -> str | None:
    """The `# N. Title` section heading above `line` in a reference file, if it has one.

    >>> import prefix_caching
    >>> section_of(Path(prefix_caching.__file__), 400)
    '3. The allocator'
    """
    heading = None
    for number, text in enumerate(path.read_text().splitlines()[:line], 1):
        match = re.match(r"# (\d+\. .+)", text)
        if match:
            heading = match.group(1)
    return heading


def where(obj) -> str:
    """'file.py:line  qualified name (section)' for a function, method or class."""
    path = Path(inspect.getsourcefile(obj))
    _, line = inspect.getsourcelines(obj)
    section = section_of(path, line)
    return f"{path.name}:{line}  {obj.__qualname__}" + (f"  (section {section})" if section else "")


def show_code(console: Console, *objects) -> None:
    """Print where() each object lives, then its source with the file's line numbers."""
    for obj in objects:
        lines, start = inspect.getsourcelines(obj)
        console.print(f"[bold]Read: {where(obj)}[/]")
        console.print(Syntax("".join(lines), "python", line_numbers=True, start_line=start, word_wrap=True))
