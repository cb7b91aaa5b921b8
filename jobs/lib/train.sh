# The body of jobs/train.sbatch (sourced after common.sh): run dir, resume, launch, requeue.

# The array task's schedule file: line SLURM_ARRAY_TASK_ID (0-based) of $HPCGNN_SCHEDULES.
hpcgnn_array_schedule() {
    [[ -n ${SLURM_ARRAY_TASK_ID:-} && -n ${HPCGNN_SCHEDULES:-} ]] || return 0
    [[ -f $HPCGNN_SCHEDULES ]] || hpcgnn_die "HPCGNN_SCHEDULES=$HPCGNN_SCHEDULES does not exist (written by jobs/sweep.sh)"
    sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" "$HPCGNN_SCHEDULES"
}

# RUN_DIR: HPCGNN_RUN_DIR, else --out from the train arguments, else one named from the job id.
hpcgnn_run_dir() {
    local schedule=$1; shift
    if [[ -n ${HPCGNN_RUN_DIR:-} ]]; then echo "$HPCGNN_RUN_DIR"; return; fi
    while [[ $# -gt 0 ]]; do
        case $1 in --out) echo "$2"; return ;; --out=*) echo "${1#--out=}"; return ;; esac
        shift
    done
    local runs=${HPCGNN_RUNS:-runs}
    if [[ -n $schedule ]]; then
        echo "$runs/sweep-$SLURM_ARRAY_JOB_ID/$(basename "$schedule" .toml)"
    else
        echo "$runs/slurm-${SLURM_JOB_ID:-local-$$}"
    fi
}

# The task count must fit the shard set with some parallel algorithm: a divisor of num_parts
# (halo: each rank loads num_parts/ntasks parts), num_parts * c (1.5d), q^2 with q dividing
# num_parts (2d) or q^3 with q^2 dividing it (3d); say so before any rank starts (the trainer
# checks the config's algorithm's exact rule again, on every rank, before it imports torch).
hpcgnn_fits() {
    local k=$1 p=$2 q
    (( k % p == 0 || p % k == 0 )) && return 0
    for (( q = 2; q * q <= p; q++ )); do
        (( q * q == p && k % q == 0 )) && return 0
        (( q * q * q == p && k % (q * q) == 0 )) && return 0
    done
    return 1
}

hpcgnn_check_shards() {
    local shards=$1 ntasks=$2 parts
    [[ -f $shards/meta.json ]] || hpcgnn_die "$shards/meta.json not found: preprocess first (jobs/preprocess.sbatch) or fix SHARDS"
    parts=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["num_parts"])' "$shards/meta.json")
    hpcgnn_fits "$parts" "$ntasks" || hpcgnn_die "$shards has num_parts=$parts but the job has $ntasks tasks: submit with --ntasks=$parts or a divisor of $parts (each rank then loads num_parts/ntasks parts), or num_parts * c for parallel.algorithm = 1.5d, q^2 with q dividing $parts for 2d, q^3 with q^2 dividing $parts for 3d"
}

# The job log's name in RUN_DIR: slurm-<job>.out, one file per start of a requeued job.
hpcgnn_log_name() {
    local restarts=${SLURM_RESTART_COUNT:-0}
    echo "slurm-$(hpcgnn_job_ref)$( ((restarts > 0)) && echo ".restart$restarts").out"
}

# A run is resumed when its last segment was preempted and it has not finished since; or when
# SLURM restarted the job without our marker (node failure, a preemption whose TERM never
# reached the ranks, scontrol requeue by hand) and a checkpoint is there: a periodic one
# (run.checkpoint_every), better to go on from than to start over, or the finished run's, when
# the restart came after training ended (then --resume trains nothing; --force would train the
# whole run again over it).
hpcgnn_needs_resume() {
    local run_dir=$1
    if [[ -f $run_dir/preempted.json ]] &&
        [[ ! -f $run_dir/summary.json || $run_dir/preempted.json -nt $run_dir/summary.json ]]; then
        return 0
    fi
    [[ ${SLURM_RESTART_COUNT:-0} -gt 0 && -f $run_dir/checkpoint.pt ]]
}

# Append one line per job segment to RUN_DIR/slurm.jsonl (which job, where, how launched).
hpcgnn_record_segment() {
    local run_dir=$1 resumed=$2
    python - "$run_dir/slurm.jsonl" "$resumed" "${LAUNCH[*]}" <<'PY'
import json, os, sys, time
path, resumed, launch = sys.argv[1:]
env = os.environ
line = {"job_id": env.get("SLURM_JOB_ID"), "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
        "array_task_id": env.get("SLURM_ARRAY_TASK_ID"), "restart_count": int(env.get("SLURM_RESTART_COUNT", 0)),
        "nodes": env.get("SLURM_JOB_NODELIST"), "ntasks": env.get("SLURM_NTASKS"),
        "cpus_per_task": env.get("SLURM_CPUS_PER_TASK"), "resumed": resumed == "1",
        "launch": launch, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
with open(path, "a") as f:
    f.write(json.dumps(line) + "\n")
PY
}

# How many times this run was started again: SLURM's requeues of this job plus the jobs
# resubmitted before it (HPCGNN_RESUBMITS, set by hpcgnn_resubmit).
hpcgnn_restarts() {
    echo $(( ${SLURM_RESTART_COUNT:-0} + ${HPCGNN_RESUBMITS:-0} ))
}

# After a preempted segment: put the job back in the queue (same id, same RUN_DIR).
hpcgnn_continue_later() {
    local run_dir=$1; shift
    local restarts max=${HPCGNN_MAX_RESTARTS:-20}
    restarts=$(hpcgnn_restarts)
    (( restarts < max )) || hpcgnn_die "preempted after $restarts restarts (HPCGNN_MAX_RESTARTS=$max); resume by hand: HPCGNN_RUN_DIR=$run_dir sbatch ..."
    case ${HPCGNN_ON_PREEMPT:-requeue} in
        requeue)
            hpcgnn_ended_by_slurm && exit 0   # a scancel must not be undone
            # Say it first: the requeue ends this shell at once.
            hpcgnn_say "checkpointed; requeueing job $(hpcgnn_job_ref) (restart $((restarts + 1)))"
            scontrol requeue "$(hpcgnn_job_ref)" && exit 0
            hpcgnn_ended_by_slurm && exit 0
            hpcgnn_say "scontrol requeue failed; resubmitting instead"
            hpcgnn_resubmit "$run_dir" "$@" ;;
        resubmit)
            hpcgnn_ended_by_slurm && exit 0   # a scancel must not be undone here either
            hpcgnn_resubmit "$run_dir" "$@" ;;
        exit) hpcgnn_say "checkpointed; resume with: HPCGNN_RUN_DIR=$run_dir sbatch jobs/train.sbatch $*" ;;
        *) hpcgnn_die "HPCGNN_ON_PREEMPT=${HPCGNN_ON_PREEMPT} is not one of requeue, resubmit, exit" ;;
    esac
}

# Is SLURM ending the job itself? After scancel it is CANCELLED; after PreemptMode=REQUEUE or
# scontrol requeue from outside it is COMPLETING/PENDING with a higher restart count. Then a
# requeue or resubmission of ours would undo a cancel or run RUN_DIR twice.
hpcgnn_ended_by_slurm() {
    local info restarts state
    info=$(scontrol show job -o "$(hpcgnn_job_ref)" 2>/dev/null) || return 1
    restarts=$(sed -n 's/.*Restarts=\([0-9]*\).*/\1/p' <<< "$info")
    state=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<< "$info")
    [[ $state != RUNNING || ${restarts:-0} -gt ${SLURM_RESTART_COUNT:-0} ]] || return 1
    hpcgnn_say "SLURM is ending the job itself (JobState=$state, Restarts=$restarts): not resubmitting"
}

# Submit the same training again as a new job that resumes RUN_DIR once this one has ended,
# with this job's time limit, nodes, memory, account, QOS, GPUs and constraints (sbatch options
# given on the command line are not in the script: without them the new job would get its
# defaults). SLURM shows a job neither its --signal nor its --output: given as SBATCH_SIGNAL and
# SBATCH_OUTPUT at submission they are in this job's environment, and sbatch reads them again.
hpcgnn_resubmit() {
    local run_dir=$1; shift
    local opts=(--dependency="afterany:$(hpcgnn_job_ref)" --ntasks="${SLURM_NTASKS:-1}"
                --job-name="$SLURM_JOB_NAME"
                --export="ALL,HPCGNN_RUN_DIR=$run_dir,HPCGNN_RESUBMITS=$(( $(hpcgnn_restarts) + 1 ))")
    local info limit gres features
    info=$(scontrol show job -o "$(hpcgnn_job_ref)" 2>/dev/null | head -n 1)
    limit=$(hpcgnn_job_field "$info" TimeLimit)
    [[ $limit =~ ^[0-9][-0-9:]*$ ]] && opts+=(--time="$limit")
    [[ -n ${SLURM_JOB_NUM_NODES:-} ]] && opts+=(--nodes="$SLURM_JOB_NUM_NODES")
    [[ -n ${SLURM_NTASKS_PER_NODE:-} ]] && opts+=(--ntasks-per-node="$SLURM_NTASKS_PER_NODE")
    [[ -n ${SLURM_MEM_PER_NODE:-} ]] && opts+=(--mem="$SLURM_MEM_PER_NODE")
    [[ -n ${SLURM_MEM_PER_CPU:-} ]] && opts+=(--mem-per-cpu="$SLURM_MEM_PER_CPU")
    [[ -n ${SLURM_MEM_PER_GPU:-} ]] && opts+=(--mem-per-gpu="$SLURM_MEM_PER_GPU")
    [[ -n ${SLURM_JOB_ACCOUNT:-} ]] && opts+=(--account="$SLURM_JOB_ACCOUNT")
    [[ -n ${SLURM_JOB_QOS:-} ]] && opts+=(--qos="$SLURM_JOB_QOS")
    [[ -n ${SLURM_JOB_PARTITION:-} ]] && opts+=(--partition="$SLURM_JOB_PARTITION")
    [[ -n ${SLURM_GPUS_PER_TASK:-} ]] && opts+=(--gpus-per-task="$SLURM_GPUS_PER_TASK")
    # --cpus-per-gpu excludes --cpus-per-task (sbatch refuses both)
    if [[ -z ${SLURM_CPUS_PER_TASK:-} && -n ${SLURM_CPUS_PER_GPU:-} ]]; then
        opts+=(--cpus-per-gpu="$SLURM_CPUS_PER_GPU")
    else
        opts+=(--cpus-per-task="${SLURM_CPUS_PER_TASK:-1}")
    fi
    [[ -n ${SLURM_GPUS:-} ]] && opts+=(--gpus="$SLURM_GPUS")
    # --gres=gpu:N and --gpus-per-node=N (no SLURM_ variable names --gres): TresPerNode=gres:gpu:N
    # (gres/gpu:N in newer SLURM), the same request as --gres=gpu:N.
    gres=$(hpcgnn_job_field "$info" TresPerNode)
    gres=${gres//gres:/} gres=${gres//gres\//}
    [[ -n $gres ]] && opts+=(--gres="$gres")
    features=$(hpcgnn_job_field "$info" Features)
    [[ -n $features ]] && opts+=(--constraint="$features")
    [[ $info == *" OverSubscribe=NO "* ]] && opts+=(--exclusive)
    local id
    # --export=ALL would hand the new job this one's identity (an array task's ids, the
    # restart count), which SLURM does not set for it: it would take itself for this job.
    id=$(env -u SLURM_ARRAY_JOB_ID -u SLURM_ARRAY_TASK_ID -u SLURM_RESTART_COUNT \
         -u HPCGNN_SCHEDULES sbatch --parsable "${opts[@]}" "$HPCGNN_HOME/jobs/train.sbatch" "$@")
    hpcgnn_say "checkpointed; submitted job $id to resume $run_dir"
    local warn=${SBATCH_SIGNAL:-$(sed -n 's/^#SBATCH --signal=//p' "$HPCGNN_HOME/jobs/train.sbatch")}
    hpcgnn_say "job $id warns at $warn (a --signal or --output given to sbatch is not carried over: give them as SBATCH_SIGNAL, SBATCH_OUTPUT)"
}

# The value of KEY in a one-line `scontrol show job -o` record; empty when absent or (null).
hpcgnn_job_field() {
    local value
    value=$(sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<< "$1" | head -n 1)
    [[ $value == "(null)" ]] || echo "$value"
}

hpcgnn_train_main() {
    local shards=$1 config=$2; shift 2
    [[ -f $config ]] || hpcgnn_die "run config $config not found (e.g. configs/cora.toml)"
    hpcgnn_env
    local ntasks=${SLURM_NTASKS:-1} schedule run_dir
    hpcgnn_check_shards "$shards" "$ntasks"
    schedule=$(hpcgnn_array_schedule)
    run_dir=$(hpcgnn_run_dir "$schedule" "$@")
    mkdir -p "$run_dir"
    hpcgnn_keep_log "$run_dir" "$(hpcgnn_log_name)"
    local extra=(--out "$run_dir") resumed=0
    [[ -n $schedule ]] && extra+=(--schedule "$schedule")
    if hpcgnn_needs_resume "$run_dir"; then
        extra+=(--resume); resumed=1
    elif [[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then
        extra+=(--force)   # this job's own run, restarted before any checkpoint: start it again
    fi
    hpcgnn_launcher
    hpcgnn_record_segment "$run_dir" "$resumed"
    hpcgnn_say "run dir $run_dir (resume: $resumed)"
    local started=$run_dir/.segment-started rc=0
    touch "$started"
    # made by rank 0 once every rank keeps a USR1 (hpcgnn_run_forwarding passes it on then)
    export HPCGNN_LISTENING=$run_dir/.ranks-listening
    rm -f "$HPCGNN_LISTENING"
    hpcgnn_run_forwarding "${LAUNCH[@]}" python -m mpi4py -m hpcgnn train \
        --shards "$shards" --config "$config" "$@" "${extra[@]}" || rc=$?
    rm -f "$HPCGNN_LISTENING"
    if [[ $rc -eq 0 && -f $run_dir/preempted.json && $run_dir/preempted.json -nt $started ]]; then
        local again=("$shards" "$config" "$@")   # an array task's schedule goes with it
        [[ -n $schedule ]] && again+=(--schedule "$schedule")
        hpcgnn_continue_later "$run_dir" "${again[@]}"
    fi
    hpcgnn_say "training ended with status $rc"
    return $rc
}
