# Every target creates or updates .venv (Python 3.11) from the repo's own files first.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv test test-slurm demo bench bench-schedule clean

venv: $(STAMP)

$(STAMP): requirements-cpu.txt pyproject.toml scripts/setup_venv.sh $(wildcard */__init__.py)
	PY=$(PY) scripts/setup_venv.sh

test: venv
	$(VPY) -m pytest tests -q

demo: venv
	$(VPY) launch/local_demo.py

bench: venv
	$(VPY) bench/bench_engine.py

# issue 4's experiment: torchtitan demo under Poisson failures, fixed vs adaptive (~20 min)
bench-schedule: venv
	OMP_NUM_THREADS=1 $(VPY) bench/bench_schedule.py $(BENCH_ARGS)

# launch/*.sbatch on a real private Slurm cluster on this machine (root: installs slurm-wlm +
# munge with apt-get through scripts/setup_slurm.sh; ~3 min)
test-slurm: venv
	TIERCKPT_SLURM_TESTS=1 OMP_NUM_THREADS=1 $(VPY) -m pytest tests/slurm -q

clean:
	rm -rf $(VENV) outputs .pytest_cache
