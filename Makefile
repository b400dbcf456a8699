# Set-up and entry points. Every target installs into ./.venv first (idempotent: the
# install re-runs only when pyproject.toml changes).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

# torch first: the pinned CPU wheel; anything else would pull a multi-GB CUDA build. pip's bytecode step runs on
# one core (about 70 s of a 2-core install); compileall does the same files on every core (a few files of torch's
# test helpers use newer Python syntax and fail there, as they do in pip, which skips them). Comments stay out of the
# recipe: make prints a recipe's comment lines as if they were commands.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile torch==2.13.0
	$(BIN)/python -m pip install --quiet --no-compile -e '.[dev,search]'
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
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
