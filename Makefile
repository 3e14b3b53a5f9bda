# The two commands: `make run` (the whole platform with a demo fleet) and `make test`.
# Both need only Python 3.11 on the machine; everything else is installed into .venv.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
# vLLM's CPU build, for the real-engine tests and the demo's CPU node: never in .venv.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: run test test-vllm bench lint clean router

# The lock files pin every package with its hashes: requirements.txt the runtime dependencies of
# pyproject.toml, requirements-dev.txt those at the same versions plus the dev and sim extras.
$(STAMP): requirements.txt requirements-dev.txt
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet --require-hashes -r requirements.txt -r requirements-dev.txt
	@touch $(STAMP)

# After editing the dependencies in pyproject.toml: `make lock` rewrites both lock files, keeping
# every pin it can (UPGRADE=--upgrade, or --upgrade-package NAME, to move them). It runs:
#   pip-compile --allow-unsafe --generate-hashes --no-emit-find-links --no-emit-index-url \
#     --strip-extras --output-file=requirements.txt pyproject.toml
#   pip-compile ... --extra=dev --extra=sim --constraint=requirements.txt \
#     --output-file=requirements-dev.txt pyproject.toml
LOCK_VENV := var/pip-tools
PIP_COMPILE = $(LOCK_VENV)/bin/pip-compile --quiet --allow-unsafe --generate-hashes \
	--no-emit-find-links --no-emit-index-url --strip-extras $(UPGRADE)
.PHONY: lock
lock:
	@test -x $(LOCK_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_VENV) && \
		$(LOCK_VENV)/bin/python -m pip install --quiet pip-tools==7.6.2; }
	$(PIP_COMPILE) --output-file=requirements.txt pyproject.toml
	$(PIP_COMPILE) --extra=dev --extra=sim --constraint=requirements.txt \
		--output-file=requirements-dev.txt pyproject.toml

$(VLLM_STAMP): requirements-cpu-node.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet -r requirements-cpu-node.txt
	@# Built for another torch: they break `import transformers`, and text models need none.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $@

# The router's hot path compiled with mypyc (serving/router/native.py); a no-op while the
# build matches the sources, and the router runs as Python where it cannot be built.
router: $(STAMP)
	$(VENV)/bin/python scripts/build_router.py

run: $(STAMP) router $(if $(filter vllm,$(PLATFORM_DEMO_ENGINE)),$(VLLM_STAMP))
	$(VENV)/bin/python scripts/run.py

test: $(STAMP) router $(VLLM_STAMP)
	$(VENV)/bin/python scripts/test.py $(ARGS)

# The real-engine tests alone (marker real_vllm); ARGS go to pytest as with `make test`.
test-vllm: $(STAMP) router $(VLLM_STAMP)
	$(VENV)/bin/python scripts/test.py -m real_vllm $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/python scripts/test.py --static-only

clean:
	rm -rf var/test staticfiles
