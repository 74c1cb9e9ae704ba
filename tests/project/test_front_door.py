"""README.md is the front door: short, the two commands, the course, and a link to every page.

The long sections live under docs/ (the measurements, the server, the analyzer, the fleet, the
names in vLLM and SGLang); the README keeps a summary of each and a link to it. Every relative
link in the README, in docs/*.md and in the lessons' and exercises' pages must lead somewhere:
to a file or folder that exists and, for `page.md#anchor`, to a heading of that page, by
GitHub's rule for heading anchors. Pure text: no torch, well under a second.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 350
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, *sorted((ROOT / "lessons").glob("*.md")), *sorted((ROOT / "exercises").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without its code blocks, so a `](` inside code is no link. Inline code spans go
    too, once a link's text has kept its brackets: "[`a.py`](a.py)" stays a link to a.py."""
    return CODE.sub("", FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, every character but letters, digits, '_',
    '-' and spaces dropped, spaces to hyphens.

    >>> anchor("When a class leans on it: limits, hang-ups, failures, Ctrl+C")
    'when-a-class-leans-on-it-limits-hang-ups-failures-ctrlc'
    >>> anchor("The admin key for /reset_prefix_cache")
    'the-admin-key-for-reset_prefix_cache'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file; a repeated one gets -1, -2, as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = anchor(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: lead outside


def broken_links(path: Path) -> list[str]:
    """The links of a page that lead nowhere, each with the reason."""
    broken = []
    for target in relative_links(path):
        file, _, fragment = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            broken.append(f"{target}: no such file or folder")
        elif fragment and where.suffix == ".md" and fragment not in anchors(where):
            broken.append(f"{target}: {where.name} has no heading with the anchor #{fragment}")
    return broken


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end != -1 else len(text)]


# --- the tests --------------------------------------------------------------------------------------


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines, at most {MAX_LINES}: move a long section to docs/"


def test_the_readme_gives_both_commands():
    commands = section(README.read_text(), "Two commands")
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^make {target}\b", commands, re.MULTILINE), f"`make {target}` is not in Two commands"
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"the Makefile has no target {target}"


def test_the_course_table_has_a_row_for_each_stage():
    rows = re.findall(r"^\| (\d+) \| `python (lessons/\S+\.py)` \|", section(README.read_text(), "The course"),
                      re.MULTILINE)
    stages = sorted(p for p in (ROOT / "lessons").glob("*.py") if re.match(r"\d\d_", p.name))
    assert rows == [(str(int(p.name[:2])), f"lessons/{p.name}") for p in stages]


def test_every_page_under_docs_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in relative_links(README)}
    pages = [page for page in DOCS if page.resolve() not in linked]
    assert not pages, f"README.md links to none of: {[str(p.relative_to(ROOT)) for p in pages]}"


def test_every_relative_link_resolves():
    broken = {str(path.relative_to(ROOT)): broken_links(path) for path in PAGES}
    broken = {path: links for path, links in broken.items() if links}
    assert not broken, "links that lead nowhere:\n" + "\n".join(
        f"{path}: {link}" for path, links in broken.items() for link in links)
    assert sum(len(relative_links(path)) for path in PAGES) > 50  # the pattern still finds the links


def test_the_link_check_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    """This test's own check, on a page written for it."""
    (tmp_path / "other.md").write_text("## A heading: with punctuation\n\n```\n## not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-punctuation) [gone](missing.md) "
                    "[no anchor](other.md#not-a-heading) `[code](missing.md)` [here](#nowhere)\n")
    broken = [link.split(": ")[0] for link in broken_links(page)]
    assert broken == ["missing.md", "other.md#not-a-heading", "#nowhere"]
    assert anchor("From our names to vLLM's and SGLang's") == "from-our-names-to-vllms-and-sglangs"


MAX_SOURCE_LINES = 800


def test_every_source_file_reads_in_one_sitting():
    """No Python file of the project (code, lessons, benchmarks, tests) past MAX_SOURCE_LINES:
    a file that grows past it is split by role (as tests/exercises/grading.py and twins.py)."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [ROOT / name for name in listed.stdout.split()]  # what git holds: no scratch file of a running test
    assert len(files) > 100  # the project's files
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_SOURCE_LINES}
    assert not long, f"past {MAX_SOURCE_LINES} lines, split by role: {long}"
