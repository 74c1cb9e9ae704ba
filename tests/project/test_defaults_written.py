"""The defaults the prose writes out, each checked against the one constant it copies.

STYLE.md, "One home for each figure and default": the target step time, the bound on a
stream's stall and the token cap of a step are constants, and the README, the docs, the
lessons, the notebooks and the docstrings also state them in words. For each default:

    phrases   the ways the prose states it ("within 400 ms and within", "`--target-step-ms`
              (400"): every number such a phrase holds must be the constant's value now;
    mentions  how its current value is written ("400 ms"): each one must sit inside a phrase
              or in ALLOWED, so a new sentence that writes the number is checked or excused.

ALLOWED lists the places those numbers are something else (a measured figure, vLLM's own
default, a fixed budget a lesson passes), each with the reason. Change DEFAULT_TARGET_STEP_MS
to 300 and test_the_prose_states_each_default_as_it_is fails, naming every copy that still
says 400; a sentence that names the constant instead (a lesson's f-string) needs nothing here.

Read: README.md, docs/*.md, lessons/*.md, exercises/*.md, the notebooks' cells, and the
string literals and comments (not the code: a number a lesson passes is its own) of the
two modules at the top, of every package (allocator/, engine/, commands/, analyzer/,
serving/, benchmarks/, lessons/) and of exercises/*.py.
"""

import io
import json
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

import engine
from engine import step_budget

ROOT = Path(__file__).resolve().parents[2]
NUM = r"(?P<n>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)"  # the number a phrase states: 400, 2,048, 2.2


@dataclass(frozen=True)
class Default:
    name: str
    value: float
    phrases: tuple[str, ...]  # regexes with a group n; a space matches any run of white space
    mentions: tuple[str, ...]  # regexes, {v} standing for the value as the prose writes it


def defaults(**values) -> list[Default]:
    """The defaults the prose states, at their values now (or at `values`, to test this test)."""
    return [
        Default("step_budget.DEFAULT_TARGET_STEP_MS", values.get("target", step_budget.DEFAULT_TARGET_STEP_MS),
                phrases=(rf"{NUM} ms target step time", rf"within {NUM} ms and within", rf"--target-step-ms`? \({NUM}",
                         rf'"target_step_ms": {NUM}', rf"as many tokens as fit in {NUM} ms",
                         rf"{NUM} ms (?:by default|unless given)"),
                mentions=(r"\b{v} ms\b", r'"target_step_ms": {v}\b', r"--target-step-ms`? \({v}\b")),
        Default("step_budget.STALL", values.get("stall", step_budget.STALL),
                phrases=(rf"within {NUM} times the", rf"{NUM} times the step the streams"),
                mentions=(r"\b{v}(?:x|\s+times)\b",)),
        Default("engine.DEFAULT_MAX_NUM_BATCHED_TOKENS", values.get("cap", engine.DEFAULT_MAX_NUM_BATCHED_TOKENS),
                phrases=(
                    # the budget sentence: "as many tokens as fit in it ..., at most 2,048"
                    rf"as many (?:prompt )?tokens as (?:fit|keep)(?:[^.]|\.(?=\S)){{0,300}}?"
                    rf"(?:at most|never more than) {NUM}",
                    # the stalls run's other way, which runs the cap as a fixed budget (benchmarks/stalls.py)
                    rf"\bfixed (?:budget of )?{NUM}(?= tokens| \|)",
                    rf'"(?:max_num_batched_tokens|budget)": {NUM}',  # /health at the defaults
                    rf"{NUM} when nothing (?:was )?waiting", rf"max_num_batched_tokens \({NUM} by default",
                    rf"one with --max-num-batched-tokens {NUM}"),  # benchmarks/stalls.py's fixed way
                mentions=(r"\b{v}\b",)),
    ]


VLLM = "vLLM's own default (get_batch_defaults in vllm/engine/arg_utils.py), true whatever ours is"
MEASURED = "a measured figure (docs/measured.md), not the default"
LESSON_FIXED = "the fixed budget stage 8's main() passes, so its counts are the same on every machine"
DOCTEST = "a doctest's own numbers"
FLEET_RUN = "the fixed budget of a measured --bench fleet run (the analyzer's --in-flight default, vLLM's)"
SLOT = "llama-server's context per slot (-c 8192 over 4 slots), not our budget"

# (file, a piece of one line that holds the number, why it is not the default)
ALLOWED = [
    ("analyzer/fleet_replay.py", "budget is 2,048 tokens a step", VLLM),
    ("docs/analyzer.md", "(2,048 by default, what `vllm serve` takes", VLLM),
    ("docs/analyzer.md", "`--max-num-batched-tokens`,\n2,048 by default", VLLM),
    ("docs/analyzer.md", "and of 2,048, open and keyed", FLEET_RUN),
    ("docs/analyzer.md", "| 2,048 | ", FLEET_RUN),
    ("docs/analyzer.md", "At 2,048 tokens a step", FLEET_RUN),
    ("docs/analyzer.md", "at 2,048 tokens a step both", FLEET_RUN),
    ("docs/measured.md", "| 2,048 | 4,529 ms |", "a prompt length in the time-to-first-token table"),
    ("docs/measured.md", "1,024, 2,048 and 4,154 shared tokens", "the shared prefixes the long-prefix demo times"),
    ("docs/measured.md", "| 10.1x, 9.3x | 2,048 |", "blocks a padded decode step copied (16 rows x 128)"),
    ("docs/measured.md", "takes 2,048, or 8,192", VLLM),
    ("docs/measured.md", "on a GPU 2,048 tokens", VLLM),
    ("docs/measured.md", "attention 2.2x and 10.2x faster", MEASURED),
    ("docs/serving.md", "their first token 2.2x and 2.15x", MEASURED),
    ("docs/serving.md", "a stream 2.2x its first token alone", MEASURED),
    ("docs/measured.md", "128 to 2,048 tokens, warm",
     "prefix lengths of the GPU run's time-to-first-token measurement"),
    ("lessons/README.md", "up to 2,048 tokens of prefix; caching paid", "a prefix length of the GPU run's TTFT measurement"),
    ("docs/server.md", "takes 2,048, or 8,192", VLLM),
    ("lessons/README.md", "takes 2,048, or 8,192", VLLM),
    ("lessons/README.md", "on a GPU 2,048 tokens", VLLM),
    ("lessons/README.md", "the stage's fixed budget of 2,048 tokens", LESSON_FIXED),
    ("lessons/README.md", "attention 2.2x and 10.2x faster", MEASURED),
    ("lessons/08_many_requests.py", "2,048 for `vllm serve`", VLLM),
    ("lessons/08_many_requests.py", "where 2,048 tokens take milliseconds", VLLM),
    ("notebooks/03_many_requests_and_serving.ipynb", "A fixed budget of 2,048 tokens a step, as the lesson's main()",
     LESSON_FIXED),
    ("notebooks/03_many_requests_and_serving.ipynb", "the fixed budget of 2,048 tokens a step (made in the",
     LESSON_FIXED),
    ("engine/step_budget.py", "head_dim=64), 400, 2048)", DOCTEST),
    ("engine/step_budget.py", "head_dim=1), 400, 2048)", DOCTEST),
    ("analyzer/kv_memory.py", "(2048, 1.95, 5.95)", DOCTEST + ": running blocks"),
    ("analyzer/llama_slots.py", "(2048, 1024)", DOCTEST + ": a llama-server slot's context"),
    ("docs/analyzer.md", "(slots of 2,048 tokens, prompts", SLOT),
    ("docs/analyzer.md", "where slots of 2,048 tokens", SLOT),
]


# --- the prose -------------------------------------------------------------------------------------


def python_prose(source: str) -> str:
    """The source with everything but its strings' text and its comments blanked out, so
    positions and lines stay where they were; a phrase may run from one string into the next."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source  # being edited: read it all
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    kept = [c if c == "\n" else " " for c in source]
    for token in tokens:
        if token.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        start = starts[token.start[0] - 1] + token.start[1]
        end = starts[token.end[0] - 1] + token.end[1]
        quotes = re.match(r"#|[rbuRBUfF]*('''|\"\"\"|'|\")", token.string)
        inner_start = start + quotes.end()
        inner_end = end - (len(quotes.group(1)) if quotes.group(1) else 0)
        kept[inner_start:inner_end] = source[inner_start:inner_end]
    return "".join(kept)


def prose() -> list[tuple[str, str, str]]:
    """(file, where in it, text) for everything read."""
    found = []
    for pattern in ("README.md", "docs/*.md", "lessons/*.md", "exercises/*.md"):
        found += [(str(p.relative_to(ROOT)), "", p.read_text()) for p in sorted(ROOT.glob(pattern))]
    packages = sorted(d.name for d in ROOT.iterdir() if (d / "__init__.py").exists() and d.name != "tests")
    paths = {p for pattern in ("*.py", "exercises/*.py", *(f"{package}/*.py" for package in packages))
             for p in ROOT.glob(pattern)}
    found += [(str(p.relative_to(ROOT)), "", python_prose(p.read_text())) for p in sorted(paths)]
    for path in sorted(ROOT.glob("notebooks/*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            text = "".join(cell["source"])
            found.append((str(path.relative_to(ROOT)), f"cell {i}, ",
                          python_prose(text) if cell["cell_type"] == "code" else text))
    return found


def written(value: float) -> str:
    """The value as prose writes it: 2048 as 2048 or 2,048; 400.0 as 400 or 400.0."""
    if float(value).is_integer():
        whole = int(value)
        return f"{whole:,}".replace(",", ",?") + (r"(?:\.0)?" if isinstance(value, float) else "")
    return re.escape(f"{value:g}")


def compile_words(pattern: str) -> re.Pattern:
    return re.compile(pattern.replace(" ", r"\s+"), re.IGNORECASE)


def problems(checked: list[Default]) -> tuple[list[str], set[int]]:
    """What the prose says wrong or leaves unexplained, and which ALLOWED entries were used."""
    found, used = [], set()
    for file, where, text in prose():
        allowed = []
        for i, (allowed_file, piece, _) in enumerate(ALLOWED):
            if allowed_file == file:
                spans = [(m.start(), m.end()) for m in re.finditer(re.escape(piece), text)]
                used |= {i} if spans else set()
                allowed += spans

        def inside(span, spans):
            return any(a <= span[0] and span[1] <= b for a, b in spans)

        def say(span, message):
            line = text.count("\n", 0, span[0]) + 1
            context = re.sub(r"\s+", " ", text[max(0, span[0] - 60): span[1] + 40]).strip()
            found.append(f"{file}:{where}line {line}: {message}\n    ... {context} ...")

        for default in checked:
            stated = []
            for phrase in default.phrases:
                for match in compile_words(phrase).finditer(text):
                    span = match.span("n")
                    if inside(span, allowed) or span in stated:
                        continue
                    stated.append(span)
                    if float(match["n"].replace(",", "")) != default.value:
                        say(span, f"says {match['n']} where {default.name} is {default.value:g}: write the "
                                  f"constant's value, or name the constant")
            for mention in default.mentions:
                for match in compile_words(mention.format(v=written(default.value))).finditer(text):
                    span = match.span()
                    if not inside(span, allowed) and not any(a < span[1] and span[0] < b for a, b in stated):
                        say(span, f"writes {default.name}'s value ({default.value:g}) where no phrase of "
                                  "tests/project/test_defaults_written.py reads it: if it states the default, add a phrase "
                                  "(or name the constant); if it is another figure, add it to ALLOWED with the reason")
    return found, used


# --- the tests --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_prose_states_each_default_as_it_is():
    found, _ = problems(defaults())
    assert not found, "the prose and the defaults disagree:\n" + "\n".join(found)


@pytest.mark.slow
def test_every_allowed_place_is_still_there():
    _, used = problems(defaults())
    stale = [ALLOWED[i][:2] for i in range(len(ALLOWED)) if i not in used]
    assert not stale, f"ALLOWED lists text no file holds any more: drop these entries {stale}"


@pytest.mark.slow
def test_a_changed_default_names_every_copy():
    """This test's own check: given other values, it reports the copies of today's."""
    found, _ = problems(defaults(target=300.0, stall=2.5, cap=3000))
    text = "\n".join(found)
    for file in ("docs/measured.md", "docs/serving.md", "docs/server.md", "lessons/README.md"):
        assert f"\n{file}:" in f"\n{text}", f"no copy of a default found in {file}"
    assert "says 400 where step_budget.DEFAULT_TARGET_STEP_MS is 300" in text
    assert "says 2.2 where step_budget.STALL is 2.5" in text
    assert "says 2,048 where engine.DEFAULT_MAX_NUM_BATCHED_TOKENS is 3000" in text


def test_the_scheduler_defaults_to_the_engines_cap():
    """scheduler.Scheduler's own max_num_batched_tokens (and exercises/given.py's copy, which
    test_given_types.py ties to it) is the engine's cap, vLLM's default: one number."""
    import inspect

    from engine import scheduler

    default = inspect.signature(scheduler.Scheduler).parameters["max_num_batched_tokens"].default
    assert default == engine.DEFAULT_MAX_NUM_BATCHED_TOKENS


def test_the_serving_pages_table_of_bounds_is_the_policys():
    """docs/serving.md's "Every bound of the default budget" lists step_budget.BOUNDS as they are
    now: who waits, the rule (with its constants' values) and where it is measured, in order."""
    page = (ROOT / "docs" / "serving.md").read_text()
    start = page.index("| who waits | the default policy holds it to | measured by | measured |")
    rows = [line.split(" | ")[:3] for line in page[start:].split("\n\n")[0].splitlines()[2:]]
    assert [[r[0].lstrip("| "), r[1], r[2]] for r in rows] == [[b.scene, b.rule, b.shown] for b in step_budget.BOUNDS]
