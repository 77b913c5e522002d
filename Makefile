# Set-up and checks. `make setup` builds .venv: torch's CPU wheel on machines without an NVIDIA
# GPU (a few hundred MB instead of several GB), the default CUDA build where `nvidia-smi` works.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup test lint typecheck proto gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)

setup: $(BIN)/python
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	elif $(BIN)/pip download -q --no-deps -d /tmp/card-torch-probe "torch==$(TORCH_VERSION)" \
			--only-binary=:all: --no-index --find-links /opt/wheels >/dev/null 2>&1; then \
		$(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	else \
		$(BIN)/pip install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX); \
	fi
	$(BIN)/pip install -q -e ".[dev,bench]"

test: setup
	$(BIN)/python -m pytest -q --durations=25

# The type checker reads the package as it installs: `card` is spread over several folders
# (pyproject's package-dir), so a link tree in .typecheck/ gives mypy the installed layout; its
# messages are mapped back to the repository's paths.
TYPECHECK_LINKS := v1:protos/card/v1 engine:engine common:card_common client:client \
	cache_service:cache_service draft_service:draft_service target_service:target_service

lint: setup
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory typecheck

typecheck:
	@$(BIN)/python -c "import mypy" 2>/dev/null || $(BIN)/pip install -q -e ".[dev]"
	@rm -rf .typecheck && mkdir -p .typecheck/card && ln -s ../../protos/card/__init__.py .typecheck/card/__init__.py
	@for pair in $(TYPECHECK_LINKS); do ln -s ../../$${pair#*:} .typecheck/card/$${pair%%:*}; done
	@MYPYPATH=.typecheck $(BIN)/mypy -p card 2>&1 | sed -e 's|^\.typecheck/card/common/|card_common/|' \
		-e 's|^\.typecheck/card/v1/|protos/card/v1/|' -e 's|^\.typecheck/card/||'; \
		exit $${PIPESTATUS[0]}

# On a machine with an NVIDIA GPU: exactness in bf16 at real sizes (1-32 in flight, plain and card),
# then forward cost against rows and tokens/s, exact on and off, each as a share of the memory-bandwidth
# roofline and beside transformers' compiled static-cache generate on the same weights (docs/engine.md,
# "Exact on every device"). Writes gpu-check.json; prints the device beside every figure.
gpu-check: setup
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device')"
	$(BIN)/python -m pytest -q tests/gpu -p no:cacheprovider
	$(BIN)/python -m card.client.bench.gpu --out gpu-check.json

# regenerate protos/card/v1/*_pb2*.py after editing a .proto (tests/services/test_protos.py checks)
proto:
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=protos --grpc_python_out=protos --pyi_out=protos protos/card/v1/*.proto
