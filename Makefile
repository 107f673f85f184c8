# The two commands a newcomer types (README): `make sweep` and `make test`. Both create the project's own .venv when
# it is missing or stale (older than pyproject.toml or this file), with the pinned CPU build of torch (a bare
# `torch` would pull a multi-GB CUDA build) and cpbench with its test extras, then run the default sweep or the tests.
# Users who bring their own environment (a CUDA torch, a cluster image) use pip directly (README, "Install").
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cpbench-installed
ARGS ?=

.PHONY: sweep test venv

sweep: $(STAMP)
	$(PY) -m cpbench sweep $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests $(ARGS)

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)
