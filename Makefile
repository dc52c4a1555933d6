# Two entry points for a newcomer: `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint bench

$(BIN)/mloco: pyproject.toml
	@echo "installing mergekit_loco and its dependencies into $(VENV) (once; torch is the big one)"
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/mloco

demo: install
	bash examples/demo.sh

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test: lint
	$(BIN)/pytest -q -p no:cacheprovider -n 2 --dist loadfile

bench: install
	$(BIN)/python benchmarks/start_time.py
	$(BIN)/python benchmarks/merge_bench.py --small
	$(BIN)/python benchmarks/train_bench.py
	$(BIN)/python benchmarks/outer_step_bench.py
