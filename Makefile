# Set-up and entry points. Every target installs into ./.venv first (idempotent: the
# install re-runs only when pyproject.toml changes).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

# torch first: the pinned CPU wheel; anything else would pull a multi-GB CUDA build. No bytecode step: compiling all
# 22,500 files of the environment took 142 s of a 2-core install, while the first imports of what a sweep and the
# tests use write their own bytecode in about 20 s (docs/ci.md). Comments stay out of the recipe: make prints a
# recipe's comment lines as if they were commands.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile torch==2.13.0
	$(BIN)/python -m pip install --quiet --no-compile -e '.[dev,search]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m qed_ray.sweep sweeps/smoke.yaml

test: $(STAMP)
	bash scripts/test.sh

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,search,bench]'

clean:
	rm -rf $(VENV)
