# The two commands of the README: `make demo` (set up + train the tiny OLMo 3 on CPU) and
# `make test` (set up + run the unit tier of the tests). Both create .venv in the repository root.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-integration test-all test-tpu test-slow test-slurm lint bench bench-peers bench-generate bench-engine bench-rl bench-serve bench-tpu-aot rehearse-gpu tpu-wheels tpu-peer-wheels

$(STAMP): pyproject.toml requirements.lock
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	# Every extra (the tests and demos use them all; `pip install olmax` alone is the lean core).
	# requirements.lock pins every package the install pulls in, so a fresh machine gets the
	# versions the tests were run with (torch==2.13.0 is the CPU build on local disk).
	$(VENV)/bin/pip install --quiet -c requirements.lock -e '.[all,test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/olmax demo

# Test tiers (markers in pyproject.toml): the unit tier by default; `integration` for the references
# run at full length, several processes, whole runs end to end and fault injection; `slow` for a
# benchmark machine. PYTEST_ARGS adds flags (CI: --junitxml to list the slowest tests).
# The unit tier runs on TEST_WORKERS processes (pytest-xdist), a test file to each, so a module's
# fixtures are built once: compiling, most of the tier's time, keeps one core busy, and CI's machine
# has two. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-integration: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m 'integration and not slow' $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow $(PYTEST_ARGS)

test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m '' $(PYTEST_ARGS)

# The TPU tier (tests/test_tpu.py, marker `tpu`) on a chip where olmax is not installed: python3 from
# PATH with src/ first on PYTHONPATH (benchmarks/tpu/env.sh installs the rest and prints the path),
# no venv, no xdist. The chip admits one process, so two pytest invocations, one after the other:
# the tests that compute in pytest's own process, then the `tpu_subprocess` ones, whose olmax
# processes open the chip under a pytest process that starts no JAX backend. Each prints its counts
# and what its tests measured (-rP: their output); the target fails if either fails.
# `OLMAX_TPU_TESTS_ON_CPU=1 make test-tpu TPU_PLATFORMS=cpu TPU_PY=.venv/bin/python` rehearses it
# on the CPU.
TPU_PY ?= python3
TPU_PLATFORMS ?= tpu,cpu
TPU_TESTS ?= tests/test_tpu.py
test-tpu:
	@rc=0; for sel in 'tpu and not tpu_subprocess' 'tpu_subprocess'; do \
	  echo "test-tpu: -m '$$sel'"; \
	  PYTHONPATH="$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH}" JAX_PLATFORMS=$(TPU_PLATFORMS) \
	    $(TPU_PY) -m pytest -q -rfEsP -p no:cacheprovider -p no:xdist -m "$$sel" $(TPU_TESTS) $(PYTEST_ARGS) \
	    || rc=1; \
	done; \
	if [ $$rc = 0 ]; then echo "test-tpu: both invocations passed"; else echo "test-tpu: FAILED"; fi; exit $$rc

# ruff over the sources, tests and benchmarks (rules: [tool.ruff] in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

# A real single-node Slurm started by the test (root; `apt-get install slurm-wlm munge` first).
test-slurm: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow tests/test_slurm.py

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/run_all.py

# olmax against OLMo-core and MaxText on the same model, three sizes (about 15 minutes, plus a
# one-time MaxText install into .peers/); run nothing else meanwhile.
bench-peers: $(STAMP)
	$(VENV)/bin/python benchmarks/peers.py

# olmax's 7B stage-1 train step on v5p-128 against MaxText 0.2.5's, compiled ahead of time (no TPU):
# per-chip memory and XLA's cost estimate (FLOPs, optimal_seconds, estimated MFU) of each, at one
# plan per run: the slice's choice (micro-batches of 2; each side's selective policies and full
# remat), then the recipe as written (full remat). MaxText from .peers/maxtext-venv (make
# bench-peers). About 25 minutes on 2 cores.
bench-tpu-aot: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_tpu_aot.py --max-micro-batch 2 --remat save_proj,full \
		--maxtext-remat minimal_with_context,minimal,full
	$(VENV)/bin/python benchmarks/bench_tpu_aot.py --remat full --maxtext-remat full

# Decode tokens/s of olmax's KV-cache generate against transformers' generate on the same random
# OLMo 3 (batch 1 and 8), compile time apart, and the cache's bytes against the formula.
bench-generate: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_generate.py

# olmax serve against transformers serve (continuous batching) and offline olmax generate: N = 1, 8,
# 32 concurrent streaming clients, aggregate tokens/s, time to first token, per-token latency.
bench-serve: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_serve.py $(BENCH_ARGS)

# An RL step's time split (sampling vs updates) and olmax's sampling tokens/s inside RL against
# transformers' sampled generate on the same model and rows; then rollouts on OLMo 3 Think's
# length profile: the static engine against the continuous one (slot utilisation, wall time, the
# same completions) and against transformers' continuous batching (generate_batch).
bench-rl: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_rl.py
	cd benchmarks && ../$(VENV)/bin/python bench_engine.py

# The continuous engine against the static one on short completions of geometric length (256
# prompts, mean 48 tokens, 16 slots): olmax generate's process wall time, each engine's best of
# three after a run that fills a compilation cache, and that their completions are the same bits.
# Then the paged KV cache against the contiguous one at the same KV budget (4 prompts x groups of
# 8 on OLMo 3 Think's length profile, a 2-layer d256 model): sequences at once, decode tokens/s,
# rollout time, shared prompt pages, preemptions, the same completions to the bit (under a minute).
bench-engine: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_admission.py
	$(VENV)/bin/python benchmarks/bench_paged.py

# The GPU check (benchmarks/gpu_check.sh) rehearsed on the CPU in a venv built like the lent
# H200's image (benchmarks/gpu_image_requirements.txt; olmax from src/, not installed): the venv
# takes 2 to 8 minutes the first time (downloads), the check 1.5 to 3 minutes on 2 cores. Not
# part of `make test`.
rehearse-gpu:
	bash benchmarks/rehearse_gpu.sh

# The wheels a TPU VM's own package index lacks (benchmarks/tpu/wheels.txt), for its Python 3.11,
# into .whl-tpu/ (ignored): a device call carries that folder, and benchmarks/tpu/env.sh installs
# them there beside the VM's index. Needs a machine with the registry (this one), not the TPU.
TPU_WHEEL_FLAGS := --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any
tpu-wheels:
	rm -rf .whl-tpu && mkdir -p .whl-tpu
	grep -v '^#' benchmarks/tpu/wheels.txt | grep . | xargs $(PY) -m pip download -q $(TPU_WHEEL_FLAGS) -d .whl-tpu
	@ls .whl-tpu | wc -l | xargs echo "tpu-wheels: wheels in .whl-tpu:"; du -sh .whl-tpu

# MaxText 0.2.5 and the wheels it needs that the TPU VM's index lacks
# (benchmarks/tpu/maxtext_wheels.txt) into .whl-maxtext/ (ignored), for the TPU check's `peers`
# section: a device call carries it beside .whl-tpu. MaxText's wheel says Python >= 3.12; the
# section fixes its two 3.12-only lines on the chip, hence --ignore-requires-python. Fails when
# the two folders together pass 48 MiB (a call carries 64 MiB, the working tree included).
tpu-peer-wheels:
	rm -rf .whl-maxtext && mkdir -p .whl-maxtext
	grep -v '^#' benchmarks/tpu/maxtext_wheels.txt | grep . | xargs $(PY) -m pip download -q \
		--ignore-requires-python $(TPU_WHEEL_FLAGS) -d .whl-maxtext
	@ls .whl-maxtext | wc -l | xargs echo "tpu-peer-wheels: wheels in .whl-maxtext:"; du -sh .whl-maxtext
	@kib=$$(du -sck .whl-maxtext $$( [ -d .whl-tpu ] && echo .whl-tpu) | tail -1 | cut -f1); \
	  echo "tpu-peer-wheels: .whl-maxtext and .whl-tpu together $$((kib / 1024)) MiB (a call carries 64)"; \
	  [ $$kib -le $$((48 * 1024)) ] || { echo "tpu-peer-wheels: over 48 MiB" >&2; exit 1; }
