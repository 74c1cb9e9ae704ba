"""
The course's stages (01_naive_prefill.py ... 10_going_further.py, each run as a script:
`python lessons/04_block_hashes.py`) and the helpers they share, imported as
`lessons.<name>`: workloads, radix_tree, words, figures, models, batch_views, reading.
A stage's file name starts with a digit, so a notebook imports it with
importlib.import_module("lessons.04_block_hashes"). README.md here is the syllabus.
"""
