# Entry points for a fresh machine. `make demo` is the main job end to end on the embedded
# default; `make test` is the default test run (CI runs it through .ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python
export KVSHOT_DATA_DIR ?= $(CURDIR)/data

.PHONY: setup demo test test-slow clean-data

setup: $(VENV)/.setup-done
$(VENV)/.setup-done: pyproject.toml scripts/setup.sh
	VENV=$(VENV) scripts/setup.sh
	touch $@

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

clean-data:
	rm -rf data
