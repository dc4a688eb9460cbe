# Every target creates or updates .venv (Python 3.11) from the repo's own files first.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv test demo bench clean

venv: $(STAMP)

$(STAMP): requirements-cpu.txt pyproject.toml scripts/setup_venv.sh $(wildcard */__init__.py)
	PY=$(PY) scripts/setup_venv.sh

test: venv
	$(VPY) -m pytest tests -q

demo: venv
	$(VPY) launch/local_demo.py

bench: venv
	$(VPY) bench/bench_engine.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
