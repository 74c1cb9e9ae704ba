# Two commands on a fresh machine; each sets up what is missing first.
#   make demo   a real model answering behind one long system prompt (MISS, then HITs)
#   make test   the whole suite, as CI runs it
.PHONY: demo test setup

PYTHON := .venv/bin/python

demo: .venv/.installed
	$(PYTHON) prefix_caching.py --demo

test: .venv/.installed
	$(PYTHON) -m pytest

setup: .venv/.installed

# setup.sh builds .venv from requirements.txt; redone when either changes.
.venv/.installed: setup.sh requirements.txt
	bash setup.sh
	touch $@
