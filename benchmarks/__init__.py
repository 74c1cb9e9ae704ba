"""Benchmarks, run as `python prefix_caching.py --bench NAME`. They print numbers; tests never time."""
