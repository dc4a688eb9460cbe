# Every target creates or updates .venv (Python 3.11) from the repo's own files first.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv lint test test-long test-slurm demo demo-elastic demo-spare bench bench-control bench-gpu bench-peers bench-reshard bench-recovery bench-schedule bench-goodput bench-small venv-torchft fault-campaign clean venv-mcore019 test-mcore-019 venv-latest test-latest test-megatron-lm test-megatron-lm-019

venv: $(STAMP)

$(STAMP): requirements-cpu.txt requirements-dev.txt pyproject.toml scripts/setup_venv.sh $(wildcard */__init__.py)
	PY=$(PY) scripts/setup_venv.sh

# ruff on every Python file of the repo; mypy on every package (pyproject [tool.mypy] files);
# then the shape checks (tierckpt_dev/shape_check.py): tierckpt's public names (≤ 16, typed), the wing
# order (a wing imports only wings below it), the adapters' imports (tierckpt, tierckpt.integration,
# tierckpt.io.*, tierckpt.cli only), the engine's size (≤ 400 lines, ≤ 20 methods) and
# that ruff and mypy cover every package; prints one line per check, fails on a violation
lint: venv
	$(VPY) -m ruff check tierckpt titan_plugin mcore_plugin tierckpt_dev tests bench launch scripts
	$(VPY) -m mypy
	$(VPY) -m tierckpt_dev.shape_check

test: venv
	$(VPY) -m pytest tests -q

# the tests marked slow (pyproject markers): workflows another test of `make test` also covers
test-long: venv
	$(VPY) -m pytest tests -q -m slow

demo: venv
	$(VPY) launch/local_demo.py

# the second act: 3 nodes → 2 after a node is lost for good, restored in-cluster (outputs/demo-elastic)
demo-elastic: venv
	$(VPY) launch/local_demo_elastic.py

# the same loss with a spare node (3 nodes + 1 spare): the spare takes over the lost node's id and
# restores its shards from the replicas; the job stays at 3 nodes (outputs/demo-spare)
demo-spare: venv
	$(VPY) launch/local_demo_elastic.py --spares 1 --out outputs/demo-spare

bench: venv
	$(VPY) bench/bench_engine.py
	$(VPY) bench/bench_reshard.py
	$(VPY) bench/bench_mcore_staging.py

# on a GPU machine (one H200): δ of save() on CUDA state (pinned staging on a side stream) and restore,
# 1 and 8 GiB per rank, vs DCP sync, DCP async_with_pinned_mem, NVRx local; last line: JSON summary;
# then the Megatron payload's staging on CUDA (bench/bench_mcore_staging.py --device cuda).
# No GPU: BENCH_ARGS=--cpu-dry-run checks the script on CPU at a tiny size.
bench-gpu: venv
	$(VPY) bench/bench_gpu.py $(BENCH_ARGS)
	if $(VPY) -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then \
	  $(VPY) bench/bench_mcore_staging.py --device cuda --mib 1024 8192; fi

# in-cluster vs persistent resharded restore of the same step (4 → 3 nodes), ABBA
# control-plane cost at 2-16 gloo processes, fits and extrapolation to 16k ranks (~5-10 min)
bench-control: venv
	OMP_NUM_THREADS=1 $(VPY) bench/bench_control.py $(BENCH_ARGS)

bench-reshard: venv
	$(VPY) bench/bench_reshard.py $(BENCH_ARGS)

# tierckpt side by side with DCP (sync, thread, process+async staging), NVRx local checkpointing
# and lm-resiliency on the same state; lm-resiliency runs in the side venv .venv-peers
# (scripts/setup_venv_peers.sh; never a dependency of the product). BENCH_ARGS e.g.
# "--mib-per-rank 256 --local-root-base /dev/shm --record"
VENVP := .venv-peers
STAMPP := $(VENVP)/.installed-stamp

$(STAMPP): requirements-peers.txt scripts/setup_venv_peers.sh
	PY=$(PY) scripts/setup_venv_peers.sh

bench-peers: venv $(STAMPP)
	OMP_NUM_THREADS=1 $(VPY) bench/bench_peers.py $(BENCH_ARGS)

# what a lost node costs, kill → next step: the demo's failure once cold (torchrun per attempt) and once
# with warm node agents, same session (BENCH_ARGS e.g. "--repeats 2 --with-stop --record")
bench-recovery: venv
	OMP_NUM_THREADS=1 $(VPY) bench/bench_recovery.py $(BENCH_ARGS)

# issue 4's experiment: torchtitan demo under Poisson failures, fixed vs adaptive (~20 min)
bench-schedule: venv
	OMP_NUM_THREADS=1 $(VPY) bench/bench_schedule.py $(BENCH_ARGS)

# issue 32: the torchtitan demo under seeded Poisson node failures (kill + wiped disk), ETTR and its
# waste per system and seed: tierckpt adaptive, tierckpt fixed intervals, torchtitan's stock DCP async,
# torchft (row kept, not run yet); the shared folder behind a 200 MB/s link (hours at the defaults;
# BENCH_ARGS e.g. "--mtbf 60 --seeds 1,2,3 --record", or "--quick" for a few minutes)
bench-goodput: venv
	OMP_NUM_THREADS=1 $(VPY) bench/bench_goodput.py $(BENCH_ARGS)

# many small tensors (issue 32 §3): a slot's first save against a steady one, a local-tier save
# against dcp.save of the same state, 2k and 20k tensors, interleaved (BENCH_ARGS e.g. "--record")
bench-small: venv
	OMP_NUM_THREADS=1 $(VPY) bench/bench_small_tensors.py $(BENCH_ARGS)

# the torchft row's side virtualenv (scripts/setup_venv_torchft.sh; never a dependency of the product)
VENVFT := .venv-torchft
venv-torchft: $(VENVFT)/.installed-stamp

$(VENVFT)/.installed-stamp: requirements-torchft.txt scripts/setup_venv_torchft.sh
	PY=$(PY) scripts/setup_venv_torchft.sh

# issue 15's fault campaign (not part of make test): seeded random faults, restart, restore,
# invariants checked from the files on disk; exit 1 on any violation (bench/fault_campaign.py)
FAULT_TRIALS ?= 300
FAULT_SEED ?= 0
FAULT_ARGS ?=
fault-campaign: venv
	OMP_NUM_THREADS=1 $(VPY) bench/fault_campaign.py --trials $(FAULT_TRIALS) --seed $(FAULT_SEED) $(FAULT_ARGS)

# launch/*.sbatch on a real private Slurm cluster on this machine (root: installs slurm-wlm +
# munge with apt-get through scripts/setup_slurm.sh; about 8 min on 2 cores)
test-slurm: venv
	TIERCKPT_SLURM_TESTS=1 OMP_NUM_THREADS=1 $(VPY) -m pytest tests/slurm -q

# tests/mcore/ on megatron-core 0.19.x: a second venv, Python 3.12, no nvidia-resiliency-ext
# (scripts/setup_venv_mcore019.sh; PY3_12 picks the interpreter)
VENV019 := .venv-mcore019
STAMP019 := $(VENV019)/.installed-stamp

venv-mcore019: $(STAMP019)

$(STAMP019): requirements-mcore019.txt pyproject.toml scripts/setup_venv_mcore019.sh $(wildcard */__init__.py)
	scripts/setup_venv_mcore019.sh

test-mcore-019: venv-mcore019
	OMP_NUM_THREADS=1 $(VENV019)/bin/python -m pytest tests/mcore -q -p no:cacheprovider

# Real Megatron-LM (pretrain_gpt.py on 2 CPU ranks, kill a node, resume from its replica).
# MEGATRON_LM_DIR: an existing checkout; otherwise scripts/get_megatron_lm.sh exports
# MEGATRON_LM_REF (default core_v0.16.1, matching .venv's megatron-core) from MEGATRON_LM_FROM
# (a local clone / bare git dir, or a URL; default GitHub) into ~/.cache/tierckpt/.
MEGATRON_LM_REF ?= core_v0.16.1
MEGATRON_LM_FROM ?=
MLM_STAMP := $(VENV)/.megatron-lm-stamp

$(MLM_STAMP): requirements-megatron-lm.txt $(STAMP)
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements-megatron-lm.txt 2>&1 | { grep -v "is ignored: it is neither" || true; }
	touch $@

test-megatron-lm: venv $(MLM_STAMP)
	@dir="$(MEGATRON_LM_DIR)"; \
	if [ -z "$$dir" ]; then dir=$$(scripts/get_megatron_lm.sh --ref $(MEGATRON_LM_REF) $(if $(MEGATRON_LM_FROM),--from $(MEGATRON_LM_FROM)) | tail -n1) || exit 1; fi; \
	echo "MEGATRON_LM_DIR=$$dir ($$(cat $$dir/.tierckpt-megatron-lm-ref 2>/dev/null || echo 'ref unknown'))"; \
	MEGATRON_LM_DIR=$$dir OMP_NUM_THREADS=1 $(VPY) -m pytest tests/mcore/test_megatron_lm.py tests/mcore/test_install.py tests/mcore/test_args.py -q -rs

# The same on Megatron-LM core_v0.19.0 in .venv-mcore019 (MEGATRON_LM_019_DIR: an existing checkout)
MEGATRON_LM_019_REF ?= core_v0.19.0
MLM019_STAMP := $(VENV019)/.megatron-lm-stamp

$(MLM019_STAMP): requirements-megatron-lm.txt $(STAMP019)
	$(VENV019)/bin/python -m pip install -q --disable-pip-version-check -r requirements-megatron-lm.txt 2>&1 | { grep -v "is ignored: it is neither" || true; }
	touch $@

test-megatron-lm-019: venv-mcore019 $(MLM019_STAMP)
	@dir="$(MEGATRON_LM_019_DIR)"; \
	if [ -z "$$dir" ]; then dir=$$(scripts/get_megatron_lm.sh --ref $(MEGATRON_LM_019_REF) $(if $(MEGATRON_LM_FROM),--from $(MEGATRON_LM_FROM)) | tail -n1) || exit 1; fi; \
	echo "MEGATRON_LM_DIR=$$dir ($$(cat $$dir/.tierckpt-megatron-lm-ref 2>/dev/null || echo 'ref unknown'))"; \
	MEGATRON_LM_DIR=$$dir OMP_NUM_THREADS=1 $(VENV019)/bin/python -m pytest tests/mcore/test_megatron_lm.py tests/mcore/test_install.py tests/mcore/test_args.py -q -rs -p no:cacheprovider

# The newest releases: torch 2.15, torchtitan 0.3.0, megatron-core 0.19.2, nvidia-resiliency-ext 0.7.0
# in a third venv (Python 3.12; scripts/setup_venv_latest.sh, requirements-latest.txt). Runs tests/mcore/
# and LATEST_TESTS: staging, restore (every source, resharding, dtypes), the readers, the DCP
# internals check and the torchtitan front end (README, "Supported versions": duration).
VENVL := .venv-latest
STAMPL := $(VENVL)/.installed-stamp
LATEST_TESTS ?= tests/mcore tests/test_dcp_compat.py tests/test_staging.py tests/test_staging_plan.py \
  tests/test_overlap_staging.py tests/test_restore_dtypes.py tests/test_restore_memory.py tests/test_plan_units.py \
  tests/test_per_rank_units.py tests/test_per_rank_values.py tests/test_cluster_read_bound.py tests/test_restore_hung_read.py \
  tests/test_engine_reshard.py tests/test_recovery.py tests/test_titan_cpu.py tests/test_titan_resume.py tests/test_titan_contract.py \
  tests/test_titan_toml.py tests/test_plan_cache.py tests/test_staging_allocate.py

venv-latest: $(STAMPL)

$(STAMPL): requirements-latest.txt pyproject.toml scripts/setup_venv_latest.sh $(wildcard */__init__.py)
	scripts/setup_venv_latest.sh

test-latest: venv-latest
	OMP_NUM_THREADS=1 $(VENVL)/bin/python -m pytest $(LATEST_TESTS) -q -p no:cacheprovider

clean:
	rm -rf $(VENV) $(VENV019) $(VENVL) $(VENVP) $(VENVFT) outputs .pytest_cache
