# The README's two commands: `make demo` (main job on the shipped Cora) and `make test`.
# Each sets up what it needs (env/setup.sh is idempotent).
VENV    ?= .venv
PY      := $(VENV)/bin/python
RANKS   ?= 4
SHARDS  ?= shards/cora-$(RANKS)
RUN     ?= runs/demo
# Open MPI from pip: allow root, allow more ranks than cores (a laptop or this 2-core box).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
# one machine has no fabric for the wheel's libfabric components to find (1 s of MPI_Init each)
export OMPI_MCA_btl ?= ^ofi
export OMPI_MCA_mtl ?= ^ofi
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
export OMP_NUM_THREADS ?= 1

.PHONY: setup setup-test demo test slurm-test clean

# env/setup.sh makes $(VENV), the venv the targets then run (not an exported HPCGNN_VENV)
setup:
	HPCGNN_VENV=$(abspath $(VENV)) bash env/setup.sh

# the test extra: pytest, PyG (the GAT reference), matplotlib, ogb, Triton (kernel tests run in
# its interpreter on CPUs); `make demo` needs none of it
setup-test:
	HPCGNN_VENV=$(abspath $(VENV)) HPCGNN_EXTRAS=test bash env/setup.sh

# Preprocess Cora once (reused when a verified shard set is already there), then train on $(RANKS)
# ranks; a second `make demo` replaces the demo's own run ($(RUN)) with --force.
demo: setup
	$(PY) -m preprocess verify $(SHARDS) >/dev/null 2>&1 || \
	  $(PY) -m preprocess --dataset cora --parts $(RANKS) --partitioner metis --out $(SHARDS) --force
	$(VENV)/bin/mpiexec -n $(RANKS) $(PY) -m mpi4py -m hpcgnn train --shards $(SHARDS) \
	  --config configs/cora.toml --out $(RUN) --force
	$(PY) -m hpcgnn summary $(RUN)

test: setup-test
	$(PY) -m pytest -q -ra --durations=25

# The SLURM suite alone, on a private one-node SLURM on localhost (root; installs slurm-wlm, munge).
slurm-test: setup-test
	HPCGNN_SLURM_TESTS=1 $(PY) -m pytest -q -ra tests/test_slurm.py

clean:
	rm -rf runs shards .pytest_cache
