# The two commands the README promises. Each installs what it needs first.
PYTHON ?= python3

.PHONY: demo test test-fast install bench bench-readme

install:
	$(PYTHON) -m pip install -q -e '.[test]'

demo:
	$(PYTHON) -m pip install -q -e '.[demo]'
	$(PYTHON) -m distcomm.demo

# Two workers (pytest-xdist), a test file each at a time: much of the suite waits (timeouts it
# provokes, processes starting), and the other worker uses that time. Files go to the workers in
# collection order (--no-loadscope-reorder: not by test count), which tests/conftest.py starts with
# the files that take minutes.
PYTEST_WORKERS ?= 2

# --durations: the CI log names the slowest tests, so the suite's time can be kept under 10 minutes.
test: install
	$(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

# The fast tier: every test not marked slow (a representative case of every collective, engine and
# feature), under a minute on 2 cores; `make test` runs the whole suite.
test-fast: install
	$(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not slow" tests

bench: install
	$(PYTHON) -m distcomm.bench --compare torch

# The README's plots and tables: every op, 8 B to 64 MiB, against torch gloo and MPICH, at world sizes 2 and 4
# (default engine), and the TCP engine at world size 2. Run it on an otherwise idle machine.
bench-readme: install
	mkdir -p docs/bench
	$(PYTHON) -m distcomm.bench --world 2 --compare torch,mpi -e 64M --plot docs/bench/world2.png --markdown docs/bench/world2.md --json docs/bench/world2.json
	$(PYTHON) -m distcomm.bench --world 4 --compare torch,mpi -e 64M --plot docs/bench/world4.png --markdown docs/bench/world4.md --json docs/bench/world4.json
	$(PYTHON) -m distcomm.bench --world 2 --backend tcp --ops all_reduce,broadcast,all_gather,all_to_all --compare torch -e 64M --plot docs/bench/tcp-world2.png --markdown docs/bench/tcp-world2.md
	$(PYTHON) -m distcomm.bench overview docs/bench/world2.json docs/bench/world4.json
