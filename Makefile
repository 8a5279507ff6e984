# The two commands the README promises. Each installs what it needs first.
PYTHON ?= python3

.PHONY: demo test install bench

install:
	$(PYTHON) -m pip install -q -e '.[test]'

demo: install
	$(PYTHON) -m distcomm.demo

test: install
	$(PYTHON) -m pytest -q tests

bench: install
	$(PYTHON) -m distcomm.bench --compare torch
