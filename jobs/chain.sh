#!/usr/bin/env bash
# Preprocess, then train once preprocessing has succeeded (--dependency=afterok).
#
#   jobs/chain.sh DATASET PARTS SHARDS CONFIG [train args]
#   HPCGNN_PREP_OPTS="--mem=64G" HPCGNN_TRAIN_OPTS="--time=4:00:00 --gpus-per-task=1" jobs/chain.sh ...
#   HPCGNN_PREP_OPTS="--ntasks=8" HPCGNN_PREP_ARGS="--partitioner ptscotch" jobs/chain.sh ...
#
# HPCGNN_*_OPTS are sbatch options (a --dependency in HPCGNN_TRAIN_OPTS joins the afterok); HPCGNN_PREP_ARGS are `python -m preprocess` arguments
# (--partitioner, --seed, --symmetrize), split on spaces.
# The training job gets --ntasks=PARTS. A verified shard set already in SHARDS is reused by the
# preprocessing job, so re-running the chain costs one short job. Prints "PREP_ID TRAIN_ID".
set -euo pipefail
jobs=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

[[ $# -ge 4 ]] || { echo "usage: $0 DATASET PARTS SHARDS CONFIG [train args]" >&2; exit 2; }
dataset=$1 parts=$2 shards=$3 config=$4; shift 4
[[ -f $config ]] || { echo "chain: config $config not found" >&2; exit 2; }

# shellcheck disable=SC2086  # the *_OPTS are lists of sbatch options, split on spaces
prep=$(sbatch --parsable ${HPCGNN_PREP_OPTS:-} "$jobs/preprocess.sbatch" "$dataset" "$parts" "$shards" ${HPCGNN_PREP_ARGS:-})
# a --dependency among HPCGNN_TRAIN_OPTS joins afterok:<prep> (a second one would replace it)
source "$jobs/lib/common.sh"
hpcgnn_split_option dependency d "${HPCGNN_TRAIN_OPTS:-}"
[[ $FOUND != *\?* ]] || { echo "chain: HPCGNN_TRAIN_OPTS has --dependency=$FOUND, whose '?' (any of) cannot join the chain's afterok:${prep%%;*}: use ',' (all of), or give it in HPCGNN_PREP_OPTS" >&2; exit 2; }
train=$(sbatch --parsable --dependency="afterok:${prep%%;*}${FOUND:+,$FOUND}" --kill-on-invalid-dep=yes \
        --ntasks="$parts" ${OPTS[@]+"${OPTS[@]}"} "$jobs/train.sbatch" "$shards" "$config" "$@")
echo "chain: preprocessing job $prep, training job $train (runs after $prep succeeds)" >&2
echo "${prep%%;*} ${train%%;*}"
