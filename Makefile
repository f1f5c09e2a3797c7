# tensorfleet: `make demo` trains the CNN on a local 1 ps + 3 worker cluster; `make test` runs
# the tests. Both set everything up first (a .venv with torch==2.13.0 installed before anything
# else, and Debian's Fashion-MNIST package when apt can be used).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
DATA_DIR := /usr/share/datasets/fashion-mnist
DEMO_STEPS ?= 3000
# make demo MODE=sync | MODE=allreduce (no ps) | MODE=async (default)
MODE ?= async
DEMO_PS := $(if $(filter allreduce,$(MODE)),0,1)

.PHONY: setup data bytecode demo test test-fast lint bench tf-reference fuzz docs clean

setup: $(VENV)/.installed

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build. pyproject keeps
# torch>=2.4 for users; the pin lives here.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test,plot,docs,sweep,rl]'
	touch $@

# Bytecode of the project's own modules, written once here: where PYTHONDONTWRITEBYTECODE is
# set (the environment of this project's machines sets it), no process writes it, and every
# process the tests start (hundreds of tasks, trials and workers) compiled tensorfleet's
# modules again from source: 0.25 s of CPU in a worker's imports (2.47 -> 2.21 s, torch
# included). pip compiled the installed packages; Python recompiles a stale file on import
# as usual, so this never changes what runs.
bytecode:
	@$(PY) -m compileall -q src tests examples

data:
	@if [ -f $(DATA_DIR)/train-images-idx3-ubyte.gz ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's dataset-fashion-mnist"; \
	  apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null; \
	else \
	  echo "note: Fashion-MNIST is not in $(DATA_DIR) and apt cannot be used here;"; \
	  echo "      the example will download it to ~/.cache/tensorfleet (or pass --data-dir)."; \
	fi

# Checkpoints, TensorBoard scalars and the PNG of the curves go to $(DEMO_LOGDIR); running the
# demo again resumes from its newest checkpoint. make demo FRESH=1 starts over.
DEMO_LOGDIR ?= runs/demo
FRESH ?=

demo: setup data bytecode
	$(VENV)/bin/tensorfleet launch --ps $(DEMO_PS) --workers 3 -- $(PY) examples/mnist_cnn.py --steps $(DEMO_STEPS) --mode $(MODE) --logdir $(DEMO_LOGDIR) $(if $(FRESH),--fresh)

# The tests run in TEST_PROCESSES pytest processes at once (pytest-xdist), each file's tests in
# one of them (--dist loadfile: a file's fixtures, e.g. its Slurm or Ray cluster, start once).
# On this project's 2-core machine: 26-27 min in one process, 17 min in two, the same tests
# passing (most of the time goes to tests that start processes and wait for them). The few tests
# that look at the machine as a whole take a lock (tests/machine_locks.py); each process uses
# one torch thread (tests/conftest.py). make test TEST_PROCESSES=0 runs them in one process.
TEST_PROCESSES ?= 2

test: setup data bytecode
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_PROCESSES) --dist loadfile

test-fast: setup bytecode
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

lint: setup
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

# Every benchmark of benchmarks/README.md (benchmarks/run_all.py's list; hours on a small
# machine), then one table: bench.md (and bench.json), in benchmarks/results/ over the
# committed tables. BENCH_ARGS goes to run_all.py: "--quick" (small settings, results in a
# temporary directory), "--out-dir DIR", "--only NAME ...". A benchmark that cannot run here
# (network namespaces need root) is skipped with its reason in the table; make bench fails
# only when one failed. The TensorFlow rows run when tensorflow-cpu installs into its own
# venv (.venv-tf), which never touches the project's torch; otherwise they say why not.
BENCH_ARGS ?=
bench: setup data
	-@$(MAKE) --no-print-directory tf-reference
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

tf-reference:
	@if [ ! -x .venv-tf/bin/python ]; then \
	  $(PYTHON) -m venv .venv-tf && .venv-tf/bin/pip install -q tensorflow-cpu numpy \
	  || { echo "tensorflow-cpu could not be installed here: the TensorFlow rows will say so"; rm -rf .venv-tf; exit 1; }; \
	fi

# The documentation site (mkdocs.yml) at http://127.0.0.1:8000; `make test` builds it strictly.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# A long fuzz run of the frame decoder and the ps request handler (docs/security.md).
FUZZ_EXAMPLES ?= 20000
fuzz: setup
	bash scripts/fuzz.sh $(FUZZ_EXAMPLES)

clean:
	rm -rf $(VENV) .venv-tf build dist src/*.egg-info .pytest_cache
