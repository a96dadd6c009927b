# Everything installs through this file: apt packages, the pinned venv, protobuf codegen.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
PROTO_SRC := $(wildcard protos/epd/v1/*.proto)
PYTEST_ARGS ?=

.PHONY: setup apt proto run test test-slow lint bench clean

setup: $(STAMP) proto

apt:
	@if ! ldconfig -p | grep -q libibverbs.so.1; then \
	  echo "installing libibverbs1 (Mooncake needs it)"; \
	  (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; \
	fi

$(STAMP): requirements.txt pyproject.toml
	@$(MAKE) --no-print-directory apt
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	@# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

proto: $(STAMP)
	@$(VPY) -m common.protogen

run: setup
	$(VENV)/bin/epd run

test: setup
	GLOG_minloglevel=2 $(VPY) -m pytest -q $(PYTEST_ARGS)

test-slow: setup
	GLOG_minloglevel=2 $(VPY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	GLOG_minloglevel=2 $(VPY) -m bench.run_all

clean:
	rm -rf $(VENV) build *.egg-info protos/epd/v1/*_pb2*.py*
