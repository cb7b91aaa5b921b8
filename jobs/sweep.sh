#!/usr/bin/env bash
# Train once per schedule file, as one job array over a shard set.
#
#   jobs/sweep.sh SHARDS CONFIG SCHEDULE.toml... [-- train args]
#   HPCGNN_TRAIN_OPTS="--time=1:00:00" HPCGNN_ARRAY_MAX=4 jobs/sweep.sh shards/cora-4 configs/cora.toml configs/schedules/*.toml
#
# Array task i trains with the i-th schedule; its run directory is runs/sweep-<array id>/<schedule
# name> (HPCGNN_RUNS changes "runs"), with the task's log, slurm-<array id>_<task>.out. Every task
# has --ntasks = the shard set's num_parts.
# HPCGNN_ARRAY_MAX caps how many tasks run at once; HPCGNN_DEPENDENCY (e.g. afterok:123) waits
# for another job (a --dependency in HPCGNN_TRAIN_OPTS joins it): when that job makes SHARDS (jobs/preprocess.sbatch), give its part count as
# HPCGNN_PARTS, since SHARDS/meta.json is not there yet. Prints the array job id.
set -euo pipefail
jobs=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
usage() { echo "usage: $0 SHARDS CONFIG SCHEDULE.toml... [-- train args]" >&2; exit 2; }

[[ $# -ge 3 ]] || usage
shards=$1 config=$2; shift 2
schedules=()
declare -A named=()   # each task's run directory is named after its schedule file
while [[ $# -gt 0 && $1 != -- ]]; do
    [[ -f $1 ]] || { echo "sweep: schedule file $1 not found" >&2; exit 2; }
    name=$(basename "$1" .toml)
    [[ -z ${named[$name]:-} ]] || { echo "sweep: $1 and ${named[$name]} would share the run directory sweep-<array id>/$name: rename one" >&2; exit 2; }
    named[$name]=$1
    schedules+=("$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"); shift
done
[[ $# -gt 0 ]] && shift  # the --
[[ ${#schedules[@]} -gt 0 ]] || usage
for arg in "$@"; do
    case $arg in --out|--out=*)
        echo "sweep: $arg would give every task one run directory; each task writes runs/sweep-<array id>/<schedule name> (HPCGNN_RUNS sets where): drop it" >&2; exit 2 ;;
    esac
done
[[ -z ${HPCGNN_RUN_DIR:-} ]] || { echo "sweep: HPCGNN_RUN_DIR=$HPCGNN_RUN_DIR would give every task one run directory: unset it (HPCGNN_RUNS sets where runs go)" >&2; exit 2; }
[[ -z ${HPCGNN_ARRAY_MAX:-} || $HPCGNN_ARRAY_MAX =~ ^[1-9][0-9]*$ ]] || { echo "sweep: HPCGNN_ARRAY_MAX=$HPCGNN_ARRAY_MAX is not a positive whole number of tasks to run at once: fix it or unset it" >&2; exit 2; }
source "$jobs/lib/common.sh"
hpcgnn_split_option array a "${HPCGNN_TRAIN_OPTS:-}"   # sbatch keeps the last --array: the sweep's
[[ -z $FOUND ]] || { echo "sweep: --array=$FOUND in HPCGNN_TRAIN_OPTS would replace the array the sweep makes from its schedule files: drop it (HPCGNN_ARRAY_MAX caps the tasks run at once)" >&2; exit 2; }
if [[ -f $shards/meta.json ]]; then
    parts=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["num_parts"])' "$shards/meta.json")
elif [[ -n ${HPCGNN_DEPENDENCY:-} && ${HPCGNN_PARTS:-} =~ ^[1-9][0-9]*$ ]]; then
    parts=$HPCGNN_PARTS   # the job it waits for makes the shard set
else
    echo "sweep: $shards/meta.json not found: preprocess first, or, when HPCGNN_DEPENDENCY waits for the job that makes it, give its part count as HPCGNN_PARTS" >&2
    exit 2
fi

runs=${HPCGNN_RUNS:-runs}
mkdir -p "$runs/sweep-lists"
list=$(cd "$runs/sweep-lists" && pwd)/$(date +%Y%m%d-%H%M%S)-$$.txt
printf '%s\n' "${schedules[@]}" > "$list"

range="0-$(( ${#schedules[@]} - 1 ))${HPCGNN_ARRAY_MAX:+%$HPCGNN_ARRAY_MAX}"
# An --export or a --dependency among HPCGNN_TRAIN_OPTS is joined to the sweep's own (a second
# one would replace it: --export=NONE dropped HPCGNN_SCHEDULES, and every task trained without
# its schedule); HPCGNN_RUNS goes with HPCGNN_SCHEDULES.
hpcgnn_split_option export "" "${HPCGNN_TRAIN_OPTS:-}"
opts=(--parsable --array="$range" --ntasks="$parts"
      --export="${FOUND:-ALL},HPCGNN_SCHEDULES=$list${HPCGNN_RUNS:+,HPCGNN_RUNS=$HPCGNN_RUNS}")
hpcgnn_split_option dependency d "${OPTS[*]}"
deps=$FOUND
if [[ -n ${HPCGNN_DEPENDENCY:-} && -n $deps ]]; then
    [[ $HPCGNN_DEPENDENCY$deps != *\?* ]] || { echo "sweep: HPCGNN_DEPENDENCY=$HPCGNN_DEPENDENCY and HPCGNN_TRAIN_OPTS's --dependency=$deps cannot be joined: one of them uses '?' (any of); give them as one" >&2; exit 2; }
    deps=$HPCGNN_DEPENDENCY,$deps
else
    deps=${HPCGNN_DEPENDENCY:-$deps}
fi
[[ -n $deps ]] && opts+=(--dependency="$deps")
id=$(sbatch "${opts[@]}" ${OPTS[@]+"${OPTS[@]}"} "$jobs/train.sbatch" "$shards" "$config" "$@")
echo "sweep: array job ${id%%;*} over ${#schedules[@]} schedules (list: $list)" >&2
echo "${id%%;*}"
