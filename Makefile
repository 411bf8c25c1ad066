PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
NPROC ?= 4

.PHONY: install test test-gpu bench demo lint

install:
	$(PIP) install -q -e '.[test]'

# The CPU suite: every test that does not need a GPU (gpu tests skip with a reason).
test: install
	$(PYTHON) -m pytest -q

# On a machine with a GPU: the gpu-marked tests only (pytest exits 5 when none are collected).
test-gpu: install
	$(PYTHON) -m pytest -q -m gpu; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "test-gpu: no gpu-marked tests collected (none exist yet)"; exit 0; fi; exit $$rc

demo: install
	nccl-pg run --nproc $(NPROC) -m nccl_pg.demo

bench: install
	$(PIP) install -q torch==2.13.0
	$(PYTHON) tools/bench_store.py
	$(PYTHON) tools/bench_host.py
	$(PYTHON) tools/bench_pg_overhead.py
	$(PYTHON) tools/bench_watchdog.py
	$(PYTHON) tools/bench_recorder.py

lint:
	$(PIP) install -q 'ruff>=0.6'
	$(PYTHON) -m ruff check .
