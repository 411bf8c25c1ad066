PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
NPROC ?= 4
# The CUDA major of the test install (13 or 12): NCCL's library, NVRTC and cuda-bindings all of that major.
CUDA_MAJOR ?= 13
# The versions every install is validated against (issue 30): pip takes them as constraints, so a fresh clone
# installs exactly these whatever was released since. One place: tools/pins/ (common.txt and one file per CUDA
# major; torch's pin picks its CPU build, which a bare `torch` from PyPI is not); `make check-latest` shows what
# the newest releases would change.
PINS = -c tools/pins/common.txt -c tools/pins/cu$(CUDA_MAJOR).txt
# The extras the suite needs: its tools (mypy included: tests/test_typing.py runs it), NCCL and NVRTC of one CUDA
# major, torch, torchft (its adapter's test), Sphinx (tests/test_docs.py builds the API reference).
TEST_EXTRAS = test,test-cu$(CUDA_MAJOR),torch,torchft,docs
# pytest-xdist workers for `make test`: 2 on 2 cores. Three were faster on this project's 2-vCPU VM (805 s against
# 936 s on 2026-12-06: with two the cores idle a third of the time) but made the timing-sensitive tests of
# faults and verdicts fail now and then (a verdict-matrix snapshot race among them): not yet. 0: one process.
TEST_WORKERS ?= 2

.PHONY: install install-test test test-sim test-gpu test-elastic bench demo lint torch-suite torchft-suite check-latest docs verdict-matrix

# The CUDA major of this machine's NVIDIA driver (empty without one): 12 for a 12.x driver, else 13.
DRIVER_CUDA_MAJOR := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1 | \
	awk '{ print ($$1 == "" ? "" : ($$1 <= 12 ? 12 : 13)) }')

# What the demo needs: the package (its numpy host backend runs without a GPU), and on a machine with an NVIDIA
# driver the CUDA extra of the driver's major (NCCL, CuPy, NVRTC), so that the demo runs on NCCL there.
install:
	$(PIP) install -q -e '.$(if $(DRIVER_CUDA_MAJOR),[cu$(DRIVER_CUDA_MAJOR)])' \
		-c tools/pins/common.txt -c tools/pins/cu$(or $(DRIVER_CUDA_MAJOR),$(CUDA_MAJOR)).txt

# Everything the CPU suite needs, so that only GPU tests skip: the test tools, NCCL's library and NVRTC of
# one CUDA major, torch's CPU build, and etcd (Debian's etcd-server) for the EtcdStore tests and chromium (Debian's)
# for the browser view's test where the machine allows (root and apt-get); elsewhere it says how to install them.
install-test:
	$(PIP) install -q -e '.[$(TEST_EXTRAS)]' $(PINS)
	@command -v etcd >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get install -y -q etcd-server >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q etcd-server >/dev/null; }; \
		else \
			echo "install-test: etcd is missing; the EtcdStore tests need it: install etcd >= 3.4 (Debian/Ubuntu: sudo apt-get install etcd-server)"; \
		fi; }
	@command -v chromium >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; \
		else \
			echo "install-test: chromium is missing; the browser view's test needs it: install it (Debian/Ubuntu: sudo apt-get install chromium), or set NCCL_PG_TEST_CHROMIUM to a Chromium binary"; \
		fi; }

# The CPU suite: every test that does not need a GPU. Tests that need one skip, saying so; any other skip fails.
test: install-test
	$(PYTHON) -m pytest -q --gpu-skips-only -n $(TEST_WORKERS)

# The NCCL backend's logic on the simulated bindings (tests/simnccl; also part of `make test`): no GPU needed.
test-sim: install-test
	$(PYTHON) -m pytest -q -m simnccl

# Elastic recovery's whole matrix (issue 33; the suite runs a selection): 8 ranks losing 4 (rank 0 among them), a
# replacement killed inside its grow, a hung rank with a death, three etcd nodes losing rank 0's node with the
# etcd leader, torchft's frozen replica over Gloo too, the elastic bench's simulated rows. About 7 min on 2 cores.
test-elastic: install-test
	ELASTIC_MATRIX=1 $(PYTHON) -m pytest -q -n $(TEST_WORKERS) tests/test_elastic.py tests/test_elastic_recovery.py \
		tests/test_elastic_nodes.py tests/test_torchft.py tests/test_reconfigure.py tests/test_nccl_sim_reconfigure.py

# On a machine with a GPU: the gpu-marked tests only (the NCCL backend, bench and doctor on a GPU).
# Without a GPU it says so and exits 0; tools/gpu_check.sh runs the whole GPU checklist on a lent machine.
# No `install` prerequisite: lent GPU machines have no network; this checkout goes on PYTHONPATH.
test-gpu:
	@export PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"; \
	ngpu=$$($(PYTHON) -c 'from nccl_pg.comm.backends import gpu_count; print(gpu_count())' 2>/dev/null || echo 0); \
	if [ "$$ngpu" = 0 ]; then \
		echo "test-gpu: no GPU on this machine (nccl_pg.comm.backends.gpu_count() == 0); nothing to run."; \
		echo "test-gpu: run it (or tools/gpu_check.sh) on a lent GPU machine, see ../shared/gpu/README.md"; \
		exit 0; \
	fi; \
	echo "test-gpu: $$ngpu GPU(s); running pytest -m gpu"; \
	$(PYTHON) -m pytest -q -m gpu; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "test-gpu: no gpu-marked tests collected"; exit 0; fi; exit $$rc

demo: install
	nccl-pg run --nproc $(NPROC) -m nccl_pg.cli.demo

bench: install-test
	$(PYTHON) tools/bench_store.py
	$(PYTHON) tools/bench_etcd_store.py
	$(PYTHON) tools/bench_host.py
	$(PYTHON) tools/bench_hot_path.py
	$(PYTHON) tools/bench_watchdog.py
	$(PYTHON) tools/bench_scale.py
	$(PYTHON) tools/bench_recorder.py
	$(PYTHON) tools/bench_nan_check.py
	$(PYTHON) tools/bench_ddp.py
	$(PYTHON) tools/bench_nccl_blocking.py

# torch's own distributed suite (DistributedTest) on gloo and on nccl_pg, 2 and 3 ranks, compared
# (about 10 min on 2 cores); exits 1 if a test passes on gloo and not on nccl_pg. Result in docs/TORCH.md.
torch-suite: install-test
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) tools/torch_suite.py --world-sizes 2 3 -q

# The API reference, from the docstrings (Sphinx autodoc; docs/api), into build/docs/html; any warning fails
# (tests/test_docs.py builds it the same way in `make test`, and checks that every public name is in it).
docs: install-test
	$(PYTHON) -m sphinx -E -b html -W --keep-going -q docs/api build/docs/html
	@echo "docs: the API reference is in build/docs/html/index.html"

# The verdict matrix (issue 32): every failure class of the catalogue through every tool that names it (about two
# minutes on 2 cores); `make test` runs a selection of it (tests/test_verdict_matrix.py's SUITE).
verdict-matrix: install-test
	NCCL_PG_VERDICT_MATRIX=all $(PYTHON) -m pytest -q -n $(TEST_WORKERS) tests/test_verdict_matrix.py

# torchft's own tests (shipped in its wheel) with its Gloo groups and with nccl_pg's adapter in their place,
# compared (tools/torchft_suite.py; exits 1 if a test passes on Gloo and not on nccl_pg outside its listed
# exceptions, or if a run crashed); then the exit-crash check of issue 31: the process-group tests on nccl_pg,
# TORCHFT_REPEAT times. Result in docs/TORCH.md. `make test` runs a selection (tests/test_torchft_suite.py).
TORCHFT_REPEAT ?= 20
torchft-suite: install-test
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) tools/torchft_suite.py
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) tools/torchft_suite.py --backends nccl_pg \
		--files process_group_test.py -k "not Baby and not baby" --repeat $(TORCHFT_REPEAT)

# ruff (SLF001 included: no reaching into another module's private members), then mypy over the package
# (configured in pyproject.toml); any finding fails. tests/test_layering.py checks the imports (`make test`).
lint:
	$(PIP) install -q -e '.[$(TEST_EXTRAS),lint]' $(PINS)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy

# Drift check, not part of `make test`: the newest releases of everything (but LATEST_KEEP, pinned still) in a
# scratch venv (LATEST_VENV), the CPU suite run there, and a report of which versions moved and which tests fail
# that pass with the pins (tools/check_latest.py; exit 1 when a newer release breaks a test). torch stays pinned
# by default: its newest PyPI release is a multi-GB CUDA build (LATEST_KEEP= floats it too).
LATEST_VENV ?= build/latest-venv
LATEST_KEEP ?= torch
check-latest:
	$(PYTHON) tools/check_latest.py --venv $(LATEST_VENV) --cuda-major $(CUDA_MAJOR) --extras '$(TEST_EXTRAS),lint' \
		--keep '$(LATEST_KEEP)' --workers $(TEST_WORKERS)
