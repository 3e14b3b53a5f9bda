# The two commands: `make run` (the whole platform with a demo fleet) and `make test`.
# Both need only Python 3.11 on the machine; everything else is installed into .venv.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test bench lint clean

$(STAMP): requirements.txt
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements.txt
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python scripts/run.py

test: $(STAMP)
	$(VENV)/bin/python scripts/test.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy serving/engine serving/router

clean:
	rm -rf var/test staticfiles
