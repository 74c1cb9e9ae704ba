"""How long does the workload analyzer take on a big log? One command.

    python prefix_caching.py --bench analyzer                   # 10,000 and 100,000 requests
    python prefix_caching.py --bench analyzer --sizes 10000     # only the first
    python prefix_caching.py --bench analyzer --quick           # 1,000: a check that it runs
    python prefix_caching.py --bench analyzer --sizes 10000 --logs /tmp/logs   # keep the log to analyse it again
    python prefix_caching.py --bench analyzer --sizes 10000 --like vllm llamacpp   # two caching models, one log
    git worktree add /tmp/base HEAD~3 && python prefix_caching.py --bench analyzer --baseline /tmp/base
    python prefix_caching.py --bench analyzer --log-size 1GiB --logs /tmp/logs   # peak memory on a big log
    python prefix_caching.py --bench analyzer --log-size 256MiB --distinct   # ... on a log of new text only

For each size it writes a log of chat requests (OpenAI bodies: one of 20 system prompts of
about 300 tokens, the popular ones more often, then a question of 50 to 350 tokens: about 500
prompt tokens a request) to a temporary file, and times `python prefix_caching.py --analyze`
on it from reading the file to the last line of its report, tokenizing with the default
model's tokenizer included, in wall-clock seconds and in seconds of this process's CPU time (a
figure other programs on the machine change less). The log is made before the clock starts;
with --like, each caching model analyses the same log in turn. With --baseline DIR (a
checkout of another commit) the same log then goes through DIR's own `python prefix_caching.py
--analyze`, whose report says how long it took (reading and tokenizing apart, as here), and
both reports' curves must be equal: a faster replay must find the same.

With --log-size SIZE the log is the chat log of 10,000 requests written again and again up to
SIZE bytes (plain JSONL: ordinary records, most of them seen before), and the command runs in a
process of its own, whose peak resident memory (getrusage's ru_maxrss, from os.wait4) is
reported beside its time; with --baseline, the baseline's too. With --distinct as well the log
holds no record twice: every request a new system prompt of about 300 tokens and a new question
of 50 to 350, its words drawn from one running seed, so nearly every block of the log is
distinct and the replays' pools grow with the log (the case that costs the analyzer most memory).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from analyzer import log_replay, workload_analyzer
from analyzer.request_logs import Writer, byte_count, chat, write_log
from benchmarks import save_json
from commands.flags import positive_int

NUM_SYSTEM_PROMPTS = 20


def chat_log(num_requests: int, seed: int = 0) -> list[dict]:
    """Chat requests of about 500 tokens behind 20 system prompts of Zipf-like popularity."""
    w = Writer(seed)
    systems = [f"You are assistant number {i} of our company. " + w.words(290) for i in range(NUM_SYSTEM_PROMPTS)]
    popularity = [1 / (rank + 1) for rank in range(NUM_SYSTEM_PROMPTS)]
    return [chat(w.rng.choices(systems, popularity)[0], w.sentence(50, 350)) for _ in range(num_requests)]


def time_analysis(path: Path, num_requests: int, like: str = "vllm", baseline: Path | None = None) -> dict:
    start, cpu_start = time.perf_counter(), time.process_time()
    report = Console(file=io.StringIO(), width=120)  # the report is not what is measured
    summary = workload_analyzer.main([str(path), "--like", like], console=report)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    result = {"requests": num_requests, "like": like, "prompt_tokens": summary.prompt_tokens,
              "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
              "reading_and_tokenizing_s": round(summary.tokenize_seconds, 1),
              "working_set_blocks": summary.working_set, "log_mib": round(path.stat().st_size / 2**20, 1),
              "load_average_after": round(os.getloadavg()[0], 2)}
    if baseline is not None:
        start = time.perf_counter()
        theirs = subprocess.run([sys.executable, "prefix_caching.py", "--analyze", str(path), "--like", like],
                                cwd=baseline,
                                capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"}, check=True)
        result["baseline_seconds"] = round(time.perf_counter() - start, 1)
        # Its own last line: "N requests analysed in T s (R s reading and tokenizing)."
        seconds, reading = re.search(r"analysed in ([\d.]+) s \(([\d.]+) s reading", theirs.stdout).groups()
        result["baseline_analysis_s"], result["baseline_reading_and_tokenizing_s"] = float(seconds), float(reading)
        ours = curve_rows(report.file.getvalue())
        result["same_curve"] = bool(ours) and curve_rows(theirs.stdout) == ours
    return result


def repeated_chat_log(path: Path, size: int) -> int:
    """Write the chat log of 10,000 requests again and again, up to about `size` bytes; its requests."""
    lines = [json.dumps(record) + "\n" for record in chat_log(10_000)]
    written = count = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            for line in lines:
                f.write(line)
                written += len(line.encode())
                count += 1
                if written >= size:
                    break
    return count


def distinct_chat_log(path: Path, size: int, seed: int = 0) -> int:
    """Write chat requests up to about `size` bytes, each with its own system prompt of about
    300 tokens and its own question of 50 to 350, from one Writer whose seed runs on: no text
    comes back, so nearly every block is new; its requests."""
    w = Writer(seed)
    written = count = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            line = json.dumps(chat(w.words(300), w.sentence(50, 350))) + "\n"
            f.write(line)
            written += len(line.encode())
            count += 1
    return count


def run_measured(command: list[str], cwd: Path) -> tuple[str, float, float]:
    """Run a command; its stdout, seconds, and its own peak resident memory in MiB (os.wait4's
    rusage: this process and no other child)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=err, env={**os.environ, "COLUMNS": "120"})
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0), err.seek(0)
        if process.returncode:
            raise RuntimeError(f"{' '.join(command)} failed: {err.read()[-2000:]}")
        return out.read(), seconds, usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def measure_memory(size: int, folder: Path, baseline: Path | None, distinct: bool = False) -> dict:
    """Write a log of about `size` bytes (the chat log repeated, or with `distinct` new chats
    only) and run the command on it: its time, peak resident memory, curve and prompt tokens."""
    path = folder / f"chat_{'distinct_' * distinct}{size}_bytes.jsonl"
    requests = (distinct_chat_log if distinct else repeated_chat_log)(path, size)
    result = {"log_mib": round(path.stat().st_size / 2**20, 1), "requests": requests}
    checkouts = {"this": Path(__file__).resolve().parents[1]} | ({"baseline": baseline} if baseline else {})
    for name, checkout in checkouts.items():
        out, seconds, peak = run_measured([sys.executable, "prefix_caching.py", "--analyze", str(path)], checkout)
        result[f"{name}_seconds"], result[f"{name}_peak_rss_mib"] = round(seconds, 1), round(peak)
        result[f"{name}_curve"] = curve_rows(out)
        tokens = re.search(r"requests,\s+([\d,]+)\s+prompt\s+tokens", out)  # the line may wrap
        result[f"{name}_prompt_tokens"] = int(tokens[1].replace(",", "")) if tokens else None
    if baseline:
        result["same_curve"] = bool(result["this_curve"]) and result["this_curve"] == result["baseline_curve"]
    return result


def curve_rows(report: str) -> list[tuple[str, ...]]:
    """The (pool size, hit rate, tokens saved, evictions) rows of a report's curve table."""
    row = r"^│ ([\d,]+)[^│]*│ [\d,]+ +│ ([\d.]+%) +│ ([\d,]+) +│ ([\d,]+) +│$"
    return re.findall(row, report, re.MULTILINE)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench analyzer", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[10_000, 100_000], help="requests in each log")
    parser.add_argument("--quick", action="store_true", help="one log of 1,000 requests")
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep the logs in this folder (default: a temporary one)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout of another commit: time its analyzer on the same logs, check the same curve")
    parser.add_argument("--like", choices=list(log_replay.LIKE), nargs="+", default=["vllm"],
                        help="the caching models to time, each on the same log (default: vllm)")
    parser.add_argument("--log-size", type=byte_count, default=None, metavar="SIZE",
                        help="instead: one log of about SIZE bytes (such as 1GiB), the command's peak memory and time")
    parser.add_argument("--distinct", action="store_true",
                        help="with --log-size: every request's text new (the default repeats 10,000 requests)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.distinct and args.log_size is None:
        parser.error("--distinct is a kind of --log-size log: give --log-size SIZE too")
    if args.log_size is not None:
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as folder:
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
            r = measure_memory(args.log_size, args.logs or Path(folder), args.baseline, args.distinct)
        r["load_average_before"], r["load_average_after"] = round(load, 2), round(os.getloadavg()[0], 2)
        console = Console()
        console.print(f"{platform.machine()}, {platform.python_version()}, load average before "
                      f"{load:.1f}, after {r['load_average_after']:.1f}: {r['requests']:,} requests, {r['log_mib']:,} MiB")
        for name in ("this", "baseline"):
            if f"{name}_seconds" in r:
                console.print(f"  {name}: {r[name + '_seconds']} s, peak RSS {r[name + '_peak_rss_mib']:,} MiB, "
                              f"{r[name + '_prompt_tokens']:,} prompt tokens")
        if "same_curve" in r:
            console.print(f"  same curve: {'yes' if r['same_curve'] else '[red]NO[/]'}")
        save_json(args.json, r, console)
        return [r]
    sizes = [1_000] if args.quick else args.sizes
    console = Console()
    console.print(f"{platform.machine()}, {platform.python_version()}, {os.cpu_count()} cores, load average "
                  f"{os.getloadavg()[0]:.1f} at the start; the default model's tokenizer")
    table = Table("requests", "--like", "prompt tokens", "log", "reading + tokenizing", "whole analysis",
                  "its CPU time", "working set",
                  *(["baseline's whole analysis (reading + tokenizing)", "same curve"] if args.baseline else []),
                  title="python prefix_caching.py --analyze LOG, timed")
    results = []
    with tempfile.TemporaryDirectory() as folder:
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
        for n in sizes:
            path = (args.logs or Path(folder)) / f"chat_{n}.jsonl"
            write_log(path, chat_log(n))
            for like in args.like:
                r = time_analysis(path, n, like, args.baseline)
                results.append(r)
                table.add_row(f"{n:,}", like, f"{r['prompt_tokens']:,}", f"{r['log_mib']} MiB",
                              f"{r['reading_and_tokenizing_s']} s", f"{r['seconds']} s", f"{r['cpu_seconds']} s",
                              f"{r['working_set_blocks']:,} blocks",
                              *([f"{r['baseline_analysis_s']} s ({r['baseline_reading_and_tokenizing_s']} s)",
                                 "yes" if r["same_curve"] else "[red]NO[/]"] if args.baseline else []))
    console.print(table)
    console.print(f"load average after each run: {', '.join(str(r['load_average_after']) for r in results)}")
    save_json(args.json, results, console)
    return results
