"""
Seeing the scheduler: what one step of continuous batching did, drawn with rich.

Read engine/scheduler.py and engine/batch_engine.py first; stage 8 (lessons/08_many_requests.py) draws its
steps with these.

    run_step       runner.step(), timed, with what the views need to know about it
    render_step    one step: who prefilled, who decoded, who waits, who was preempted, each
                   running request's blocks with the shared ones marked, and the pool
    step_history   a table, one row per step; add_step_row fills it
    block_ranges   [0, 1, 2, 3, 7, 8] -> "0-3 7-8"

Colours: cyan = prefill, green = decode, yellow = waiting, red = preempted, dim = finished;
a block in magenta is in more than one running request's table (ref count > 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from engine.batch_engine import BatchRunner
from engine.scheduler import Request, ScheduledRequest

PREFILL, DECODE, WAITING, PREEMPTED, FINISHED, SHARED = "cyan", "green", "yellow", "red", "dim", "bold magenta"


# -----------------------------------------------------------------------------
# 1. One step, recorded


@dataclass
class StepRecord:
    """What one runner.step() did, read off its plan and the scheduler around it."""

    number: int
    scheduled: list[ScheduledRequest]
    admitted: set[str]  # waiting before the step, scheduled in it (first time, or back after a preemption)
    preempted: list[Request]
    held: dict[str, int]  # tokens each preempted request had computed when its blocks were taken
    finished: list[Request]
    waiting: list[str]  # after the step, in queue order
    ms: float

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.scheduled)

    def prefills(self) -> list[ScheduledRequest]:
        """Requests computing part of a prompt in this step: admitted in it (their prompt, or their
        whole text after a preemption), or running and taking their prompt's next chunk."""
        return [s for s in self.scheduled if s.request.request_id in self.admitted or s.is_prefill]

    def decodes(self) -> list[ScheduledRequest]:
        return [s for s in self.scheduled if s not in self.prefills()]


def run_step(runner: BatchRunner, number: int) -> StepRecord:
    """One runner.step(): schedule, one forward pass for every scheduled token, sample."""
    scheduler = runner.scheduler
    waiting_before = {r.request_id for r in scheduler.waiting}
    # A running request has computed every token but the one it sampled last.
    held_before = {r.request_id: len(r.token_ids) - 1 for r in scheduler.running}
    start = time.perf_counter()
    finished = runner.step()
    ms = (time.perf_counter() - start) * 1e3
    plan = runner.last_plan
    return StepRecord(
        number=number, scheduled=plan.scheduled, preempted=plan.preempted,
        admitted={s.request.request_id for s in plan.scheduled} & waiting_before,
        held={r.request_id: held_before[r.request_id] for r in plan.preempted},
        finished=finished, waiting=[r.request_id for r in scheduler.waiting], ms=ms,
    )


# -----------------------------------------------------------------------------
# 2. Views


def _runs(ids: list[int], key=lambda block_id: None) -> list[list[int]]:
    """Split ids into runs of consecutive numbers with the same key."""
    runs: list[list[int]] = []
    for block_id in ids:
        if runs and block_id == runs[-1][-1] + 1 and key(block_id) == key(runs[-1][-1]):
            runs[-1].append(block_id)
        else:
            runs.append([block_id])
    return runs


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def block_ranges(ids: list[int]) -> str:
    """A block table, short: runs of consecutive block ids as first-last.

    >>> block_ranges([0, 1, 2, 3, 7, 8, 12])
    '0-3 7-8 12'
    """
    return " ".join(_run_text(run) for run in _runs(ids))


def _what(record: StepRecord, s: ScheduledRequest) -> Text:
    n = s.end - s.start
    if s not in record.prefills():
        return Text(f"decode token {s.start}", style=DECODE)
    kind = "prefill" if s.request.num_preemptions == 0 else "resume"
    if s.request.request_id not in record.admitted:
        kind = "next chunk,"  # running, its prompt coming in pieces
    return Text(f"{kind} tokens {s.start}-{s.end - 1} ({n:,})", style=PREFILL)


def render_step(record: StepRecord, runner: BatchRunner) -> Panel:
    """One step, drawn right after run_step: a row per request it touched or that waits,
    each running request's block table (shared blocks in magenta), the shared blocks with
    their ref counts, and the pool."""
    scheduler, alloc = runner.scheduler, runner.scheduler.allocator
    shared = scheduler.shared_blocks()
    table = Table(box=None, pad_edge=False)
    for column in ("request", "this step", "hit in the pool", "blocks (table)", "computed"):
        table.add_column(column, justify="right" if column in ("hit in the pool", "computed") else "left")

    finished = {r.request_id for r in record.finished}
    for s in record.scheduled:
        rid = s.request.request_id
        hit = f"{s.start:,}" if rid in record.admitted else ""
        if rid in finished:
            table.add_row(rid, _what(record, s), hit, Text("finished: blocks freed", style=FINISHED), "")
            continue
        blocks = Text()
        for run in _runs(alloc.block_tables[rid], key=lambda b: b in shared):
            blocks.append(_run_text(run), style=SHARED if run[0] in shared else "").append(" ")
        # A chunk that stops part-way through a prompt: how far it got, of how many.
        computed = f"{s.end:,}" if s.samples else f"{s.end:,} of {len(s.request.token_ids):,}"
        table.add_row(rid, _what(record, s), hit, blocks, computed)
    for r in record.preempted:
        table.add_row(r.request_id, Text(f"preempted: held {record.held[r.request_id]:,} tokens", style=PREEMPTED),
                      "", Text("freed, last block first; full ones stay cached", style=PREEMPTED), "0")
    preempted = {r.request_id for r in record.preempted}
    for place, rid in enumerate(record.waiting, 1):
        if rid not in preempted:
            table.add_row(rid, Text(f"waiting, {place} in the queue", style=WAITING), "", "", "0")

    by_holders: dict[tuple[str, ...], list[int]] = {}
    for block_id, holders in shared.items():
        by_holders.setdefault(tuple(holders), []).append(block_id)
    lines = [Text.assemble("shared blocks ", (block_ranges(ids), SHARED), f": ref count {len(holders)} ({', '.join(holders)})")
             for holders, ids in by_holders.items()] or [Text("shared blocks: none")]
    cached_free = sum(1 for b in alloc.free_queue if b.block_hash is not None)
    lines.append(Text(f"pool: {alloc.num_blocks_in_use} blocks in use, {alloc.num_free_blocks} free "
                      f"({cached_free} of them still cached) of {alloc.num_blocks}"))
    prefill_tokens = sum(s.end - s.start for s in record.prefills())
    title = (f"step {record.number}: one forward pass over {record.num_tokens:,} tokens "
             f"({prefill_tokens:,} prefill + {len(record.decodes())} decode), {record.ms:,.0f} ms")
    return Panel(Group(table, *lines), title=title, title_align="left")


def step_history(title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("step", "prefill (tokens)", "decode", "tokens in the batch", "waiting", "preempted", "ms"):
        table.add_column(column, justify="right" if column in ("step", "tokens in the batch", "ms") else "left")
    return table


def add_step_row(table: Table, record: StepRecord) -> None:
    prefills = ", ".join(f"{s.request.request_id} ({s.end - s.start:,})" for s in record.prefills())
    decodes = [s.request.request_id for s in record.decodes()]
    table.add_row(str(record.number), Text(prefills, style=PREFILL),
                  Text(", ".join(decodes) if len(decodes) < 5 else f"{len(decodes)} requests", style=DECODE),
                  f"{record.num_tokens:,}", Text(", ".join(record.waiting), style=WAITING),
                  Text(", ".join(r.request_id for r in record.preempted), style=PREEMPTED), f"{record.ms:,.0f}")

