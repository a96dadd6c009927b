# Everything installs through this file: apt packages, the pinned venv, protobuf codegen.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
PROTO_SRC := $(wildcard protos/epd/v1/*.proto)
PYTEST_ARGS ?=

.PHONY: setup apt proto run test test-slow lint bench bench-peers clean

setup: apt $(STAMP) proto

# libibverbs1: Mooncake's transfer engine links it. prometheus: the metrics/dashboard tests.
# chromium: the status page's test loads it in a headless browser. curl: `epd run`'s hint test.
# libtcmalloc-minimal4: the model processes' allocator (common/allocator.py).
# gcc: builds the native element-wise kernels at first use (common/native_kernels.py).
apt:
	@missing=""; \
	command -v cc >/dev/null || missing="$$missing gcc libc6-dev"; \
	ldconfig -p | grep -q libibverbs.so.1 || missing="$$missing libibverbs1"; \
	ldconfig -p | grep -q libtcmalloc_minimal.so.4 || missing="$$missing libtcmalloc-minimal4"; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  ($$SUDO apt-get update -qq || true) && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
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
	GLOG_minloglevel=2 MC_LOG_LEVEL=ERROR $(VPY) -m pytest -q $(PYTEST_ARGS)

test-slow: setup
	GLOG_minloglevel=2 MC_LOG_LEVEL=ERROR $(VPY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	GLOG_minloglevel=2 MC_LOG_LEVEL=ERROR $(VPY) -m bench.run_all

# ours vs vLLM's CPU build (installed into .peers/, never .venv); PEERS_ARGS="--quick --aiperf"
bench-peers: setup
	GLOG_minloglevel=2 MC_LOG_LEVEL=ERROR $(VPY) -m bench.peers $(PEERS_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info protos/epd/v1/*_pb2*.py*
