"""Benchmarks, run as `python prefix_caching.py --bench NAME`. They print numbers; tests never time."""

import json


def save_json(path: str | None, results, console) -> None:
    """Write a benchmark's results to `path` (its --json), if one was given, and say so."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
        console.print(f"wrote {path}")
