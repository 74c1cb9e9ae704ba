# Two commands on a fresh machine; each sets up what is missing first.
#   make demo   a real model answering behind one long system prompt (MISS, then HITs)
#   make test   the whole suite, as CI runs it
# For contributors, between two edits:
#   make test-fast   the allocator, request, scheduler, exercises' reference and the analyzer's pure
#                    parts: every test without a heavy cost marker (tests/conftest.py), under a minute
.PHONY: demo test test-fast setup

PYTHON := .venv/bin/python

demo: .venv/.installed
	$(PYTHON) prefix_caching.py --demo

# Two processes, a test file each at a time (pytest-xdist): half the suite waits on servers,
# children and sockets, so two keep both cores busy.
test: .venv/.installed
	$(PYTHON) -m pytest -n 2 --dist loadfile

test-fast: .venv/.installed
	$(PYTHON) -m pytest --fast

setup: .venv/.installed

# setup.sh builds .venv from requirements.txt; redone when either changes.
.venv/.installed: setup.sh requirements.txt
	bash setup.sh
	touch $@
