"""The versions the prose names are the ones requirements.txt pins.

sglang-router's version is written wherever a comment or a page cites the router's source (its
flags, its files, what it does to a request): the code reads it from requirements.txt
(analyzer.fleet.ROUTER_VERSION); every sentence that writes it is held to the pin here, so a
new pin makes each of them fail until it is checked against the new release.
"""

import os
import re
from pathlib import Path

from analyzer.fleet import ROUTER_VERSION, pinned_version

ROOT = Path(__file__).resolve().parents[2]
# "sglang-router 0.3.2", "sglang-router==0.3.2", "... router ..., pinned to 0.3.2", "...-gateway/ at its version 0.3.2"
MENTIONS = re.compile(r"(?:sglang-router[ =]+|(?:router|gateway)[^.]{0,80}?(?:pinned to|at its version) )(\d+\.\d+\.\d+)")


def texts() -> list[Path]:
    found = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("lessons/*.md"), *ROOT.glob("notebooks/*.ipynb")]
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if name not in (".venv", ".git")]  # never walked into
        found += [Path(folder) / name for name in files if name.endswith(".py")]
    return found


def test_the_router_version_is_read_from_requirements_txt():
    assert ROUTER_VERSION == pinned_version("sglang-router")
    assert f"sglang-router=={ROUTER_VERSION}" in (ROOT / "requirements.txt").read_text().splitlines()


def test_every_version_of_the_router_the_prose_writes_is_the_pinned_one():
    wrong, seen = [], 0
    for path in texts():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in MENTIONS.finditer(line):
                seen += 1
                if match.group(1) != ROUTER_VERSION:
                    wrong.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert seen >= 8, "the pattern no longer finds the mentions it was written for"
    assert not wrong, f"requirements.txt pins sglang-router {ROUTER_VERSION}; these write another:\n" + "\n".join(wrong)
