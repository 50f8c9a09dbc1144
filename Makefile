# The two entry points: `make demo` (set up, then run the demo) and `make test` (set up, then
# lint + types + the whole test suite). Both create .venv with pinned dependencies; `make test`
# also installs Debian's postgresql, chromium and chromium-driver, and nodejs/npm and the
# TypeScript example's pinned packages.
PYTHON ?= python3
# The test suite runs in this many processes (pytest-xdist), each with its own Temporal dev
# server and PostgreSQL: its tests mostly wait on servers, worker processes and timeouts, so
# two keep a 2-core machine busy (14-15 min; in one, ~21). TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 2
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench setup clean docs-images

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/dmem demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	scripts/ensure-postgres
	scripts/ensure-node
	scripts/ensure-chromium
	$(BIN)/pytest -n $(TEST_WORKERS)

test: lint typecheck unit

# Every benchmark beside its floor (about 22 minutes on 2 cores), then the plots in docs/.
# The distributed one runs under pg_virtualenv (Debian's postgresql-common): a throwaway
# PostgreSQL cluster on loopback for the length of the run.
bench: $(STAMP)
	scripts/ensure-postgres
	mkdir -p bench/results
	$(BIN)/python -m bench.pipeline --out bench/results/pipeline.json
	$(BIN)/python -m bench.idle --out bench/results/idle.json
	$(BIN)/python -m bench.context_compile --out bench/results/context_compile.json
	$(BIN)/python -m bench.archive_search --out bench/results/archive_search.json
	$(BIN)/python -m bench.recall_search --out bench/results/recall_search.json
	$(BIN)/python -m bench.memory --out bench/results/memory.json
	$(BIN)/python -m bench.embed_burst --out bench/results/embed_burst.json
	$(BIN)/python -m bench.profile_turn
	pg_virtualenv -t -o max_connections=200 \
		$(BIN)/python -m bench.distributed --out bench/results/distributed.json
	$(BIN)/python -m bench.prompt_cache --out bench/results/prompt_cache.json
	$(BIN)/python -m bench.governance --out bench/results/governance.json
	$(BIN)/python -m bench.plots

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

# The pictures of docs/architecture.md and docs/deploy.md from their sources beside them
# (dot: Debian's graphviz), and the review page's screenshots, taken by its browser test
# (docs/review.md).
docs-images: $(STAMP)
	dot -Tpng -Gdpi=110 docs/layers.dot -o docs/layers.png
	dot -Tpng -Gdpi=110 docs/deploy.dot -o docs/images/deploy-hosts.png
	$(BIN)/python docs/turn_sequence.py
	scripts/ensure-chromium
	DMEM_REVIEW_SCREENSHOTS=docs/images $(BIN)/pytest -q tests/test_review_browser.py
