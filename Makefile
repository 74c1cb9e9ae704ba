# Two commands on a fresh machine; each sets up what is missing first.
#   make demo   a real model answering behind one long system prompt (MISS, then HITs)
#   make test   the whole suite, as CI runs it
# For contributors, between two edits:
#   make test-fast   the allocator, request, scheduler, exercises' reference and the analyzer's pure
#                    parts: every test without a heavy cost marker (tests/conftest.py), under a minute
.PHONY: demo test test-fast setup

PYTHON := .venv/bin/python

demo: setup
	$(PYTHON) prefix_caching.py --demo

# Two processes, a test file each at a time (pytest-xdist): half the suite waits on servers,
# children and sockets, so two keep both cores busy. One torch thread each: two processes of
# two threads on two cores spin waiting for each other (8 min 7 s of suite, 7 min 38 s so).
test: setup
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -n 2 --dist loadfile

test-fast: setup
	$(PYTHON) -m pytest --fast

# setup.sh builds .venv from requirements.txt, or completes a prepared one .venv links to; it
# returns at once when neither file changed since (their hash is kept in .venv/.installed).
setup:
	bash setup.sh
