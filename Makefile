# Two commands do all the set-up on a fresh machine:
#   make run    generate text with the bundled demo model
#   make test   run the test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= def fibonacci(n):

.PHONY: run test bench clean

$(VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard csrc/*)
	test -x $(PY) || python3 -m venv $(VENV)
	# the CPU build of torch lies on disk here; pinning it keeps pip from fetching a CUDA build
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/moerun generate "$(PROMPT)" --max-tokens 64

test: $(VENV)/.installed
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build
