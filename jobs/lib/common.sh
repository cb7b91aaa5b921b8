# Shared by the jobs/*.sbatch scripts (sourced, not run). Everything cluster-specific that the
# library must not know lives here or in env/site.sh: modules, the venv, the launcher, binding.
#
# Variables a user may set (sbatch --export or the environment at submission):
#   HPCGNN_HOME      the repository (default: found from the submitted script's path)
#   HPCGNN_VENV      the virtual environment (default: $HPCGNN_HOME/.venv)
#   HPCGNN_SITE      a site file sourced first (default: $HPCGNN_HOME/env/site.sh if present)
#   HPCGNN_LAUNCHER  auto (default) | srun | mpirun
#   HPCGNN_SRUN_MPI  the srun --mpi= plugin (default: pmix for Open MPI, pmi2 for MPICH)
#   HPCGNN_RESIGNAL  seconds between the USR1s sent to signalled ranks (default 5)

# Split a list of sbatch options given as one string (HPCGNN_TRAIN_OPTS, split on spaces) into
# the array OPTS and, in FOUND, the values of option --LONG (or -SHORT) among them (--LONG=X,
# --LONG X, -S X, -SX; comma-joined): sbatch keeps only the last --dependency or --export it is
# given, so jobs/chain.sh and jobs/sweep.sh join them with their own instead of passing a
# second one.
hpcgnn_split_option() {
    local long=$1 short=$2 words=() word next=0
    OPTS=() FOUND=""
    read -r -a words <<< "$3"
    for word in "${words[@]}"; do
        if (( next )); then FOUND+=${FOUND:+,}$word; next=0; continue; fi
        if [[ $word == "--$long="* ]]; then FOUND+=${FOUND:+,}${word#--"$long"=}
        elif [[ $word == "--$long" || ( -n $short && $word == "-$short" ) ]]; then next=1
        elif [[ -n $short && $word == "-$short"?* ]]; then FOUND+=${FOUND:+,}${word#-"$short"}
        else OPTS+=("$word"); fi
    done
}

hpcgnn_say() { printf '[%s %s] %s\n' "${SLURM_JOB_NAME:-hpcgnn}" "$(date +%H:%M:%S)" "$*" >&2; }
hpcgnn_die() { hpcgnn_say "error: $*"; exit 2; }

# Source the site file (module loads, network interface, ...) and activate the venv.
hpcgnn_env() {
    local site=${HPCGNN_SITE:-$HPCGNN_HOME/env/site.sh}
    if [[ -f $site ]]; then
        hpcgnn_say "sourcing site file $site"
        hpcgnn_source_lenient "$site"
    elif [[ -n ${HPCGNN_SITE:-} ]]; then
        hpcgnn_die "HPCGNN_SITE=$HPCGNN_SITE does not exist: point it at your site file or unset it"
    fi
    # sbatch --export=NONE (or a list without ALL): the job lacks the submitting shell's
    # variables, and srun, which reads SLURM_EXPORT_ENV, would start every rank with an empty
    # environment (no PATH, no venv): the ranks get this script's environment instead.
    local exported=${SLURM_EXPORT_ENV:-ALL}
    [[ $exported == ALL* ]] || export SLURM_EXPORT_ENV=ALL
    local venv=${HPCGNN_VENV:-$HPCGNN_HOME/.venv} how="set HPCGNN_VENV"
    [[ $exported == ALL* ]] || how="the job was submitted with --export=${exported%%,*}: pass it as --export=${exported%%,*},HPCGNN_VENV=DIR or set it in env/site.sh"
    [[ -x $venv/bin/python ]] || hpcgnn_die "no venv at $venv: run 'bash env/setup.sh' on a login node, or $how"
    hpcgnn_source_lenient "$venv/bin/activate"
    OMP_NUM_THREADS=$(hpcgnn_cpus_per_task)
    export OMP_NUM_THREADS
    if [[ $(id -u) -eq 0 ]]; then  # Open MPI refuses root without both of these
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
}

# Source FILE with unset variables allowed (set +u), then put set -u back as it was. Module
# systems read variables that may be unset: Lmod 9.2.4's `module` reads LD_PRELOAD and
# LD_LIBRARY_PATH (TACC/Lmod#835), Environment Modules 4.1's init other ones (envmodules#151),
# and under the jobs' `set -u` a site file's `module load` ended the job ("unbound variable").
hpcgnn_source_lenient() {
    local nounset=0
    if [[ $- == *u* ]]; then nounset=1; fi
    set +u
    # shellcheck disable=SC1090
    source "$1"            # not in a || list: set -e still ends the job at a failing line
    if (( nounset )); then set -u; fi
}

# The CPUs of one rank: --cpus-per-task; else --cpus-per-gpu times --gpus-per-task (SLURM sets
# no SLURM_CPUS_PER_TASK for a job that asked for CPUs per GPU, and its ranks got one CPU and
# one thread each), or, with the GPUs asked for per node or per job (--gpus-per-node, --gres,
# --gpus), times this node's GPUs over its tasks; else 1.
hpcgnn_cpus_per_task() {
    local gpus=${SLURM_GPUS_PER_TASK:-} tasks cpus
    gpus=${gpus##*:}                           # a typed request, a100:1, counts its GPUs
    tasks=$(hpcgnn_node_tasks)
    if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then echo "$SLURM_CPUS_PER_TASK"
    elif [[ ${SLURM_CPUS_PER_GPU:-} =~ ^[0-9]+$ && $gpus =~ ^[0-9]+$ ]]; then
        echo $(( SLURM_CPUS_PER_GPU * gpus ))
    elif [[ ${SLURM_CPUS_PER_GPU:-} =~ ^[0-9]+$ && ${SLURM_GPUS_ON_NODE:-} =~ ^[1-9][0-9]*$ &&
            $tasks =~ ^[1-9][0-9]*$ ]]; then
        cpus=$(( SLURM_CPUS_PER_GPU * SLURM_GPUS_ON_NODE / tasks ))
        echo $(( cpus > 0 ? cpus : 1 ))
    else echo 1; fi
}

# The job's tasks on this node: the first count of SLURM_TASKS_PER_NODE (e.g. 4(x2),3); without
# SLURM_NTASKS (no task count asked for) that counts CPUs, and the job has one task.
hpcgnn_node_tasks() {
    local tasks=1
    [[ -n ${SLURM_NTASKS:-} ]] && tasks=${SLURM_TASKS_PER_NODE:-1}
    echo "${tasks%%[(,]*}"
}

# This job's name for scontrol: A_T for an array task (its plain id may equal the array's id, and
# `scontrol show job`/`requeue` of that id means every task of the array), else the job id.
hpcgnn_job_ref() {
    if [[ -n ${SLURM_ARRAY_TASK_ID:-} ]]; then echo "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
    else echo "${SLURM_JOB_ID:-none}"; fi
}

# SLURM opened the job's output file in the job's working directory, where the script starts
# (the submission directory, or sbatch --chdir; #SBATCH --output=%x-%j.out): move it into DIR
# as NAME, so the log lies with the run it describes, not in the repository. The open file
# keeps receiving the output (a rename on one file system). An --output of the user's choosing,
# or a DIR on another file system, leaves the file where it is.
hpcgnn_keep_log() {
    local dir=$1 name=$2 default info
    [[ -n ${SLURM_JOB_ID:-} ]] || return 0
    default=$PWD/${SLURM_JOB_NAME}-${SLURM_JOB_ID}.out
    info=$(scontrol show job -o "$(hpcgnn_job_ref)" 2>/dev/null | head -n 1)
    # StdOut= is the default file (its path may hold spaces: compare, do not cut at a space)
    [[ -f $default && ( $info == *" StdOut=$default "* || $info == *" StdOut=$default" ) ]] || return 0
    mkdir -p "$dir"
    if [[ $(stat -c %d "$dir") != "$(stat -c %d "$PWD")" ]]; then
        hpcgnn_say "job log stays in $default ($dir is on another file system)"
        return 0
    fi
    mv "$default" "$dir/$name" && hpcgnn_say "job log moved to $dir/$name"
}

# Print the MPI library mpi4py was built against, without initialising MPI.
hpcgnn_mpi_flavour() {
    python - <<'PY'
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
v = MPI.Get_library_version()
print("openmpi" if "Open MPI" in v else "mpich" if ("MPICH" in v or "MVAPICH" in v or "Intel" in v) else "other")
PY
}

# Can srun start a rank with this MPI plugin? (Listed is not enough: Debian's pmix plugin is
# listed but fails at launch without libpmix-dev.) One 1-task step, about a second.
srun_has_mpi() {
    srun --mpi=list 2>&1 | grep -qw "$1" || return 1
    srun --mpi="$1" --ntasks=1 --cpus-per-task=1 true >/dev/null 2>&1
}

# Does this node's allocation hold more CPUs than the node has online? (A SLURM that declares
# extra CPUs, as env/slurm/up.sh does on small machines, SlurmdParameters=config_overrides.)
hpcgnn_oversubscribed() {
    [[ ${SLURM_CPUS_ON_NODE:-0} -gt $(getconf _NPROCESSORS_ONLN) ]]
}

# Fill the array LAUNCH with the command that starts $SLURM_NTASKS ranks of one program.
hpcgnn_launcher() {
    local want=${HPCGNN_LAUNCHER:-auto} flavour plugin
    local ntasks=${SLURM_NTASKS:-1} cpus
    cpus=$(hpcgnn_cpus_per_task)
    flavour=$(hpcgnn_mpi_flavour) || hpcgnn_die "mpi4py does not import in $(command -v python): run env/setup.sh"
    case $flavour in openmpi) plugin=pmix ;; *) plugin=pmi2 ;; esac
    plugin=${HPCGNN_SRUN_MPI:-$plugin}
    if [[ $want == auto ]]; then
        if hpcgnn_oversubscribed; then
            want=mpirun   # srun's direct launch of pip's Open MPI fails for ranks past the cores
            hpcgnn_say "node oversubscribed ($SLURM_CPUS_ON_NODE CPUs allocated, $(getconf _NPROCESSORS_ONLN) online): mpirun, unbound ranks"
        elif [[ -n ${SLURM_JOB_ID:-} ]] && srun_has_mpi "$plugin"; then want=srun; else want=mpirun; fi
    fi
    case $want in
        # srun no longer passes --cpus-per-task from sbatch to the step (Slurm >= 22.05): say it.
        srun) LAUNCH=(srun --mpi="$plugin" --ntasks="$ntasks" --cpus-per-task="$cpus" --kill-on-bad-exit=1) ;;
        mpirun)
            LAUNCH=(mpirun -n "$ntasks")
            if [[ $flavour == openmpi ]] && hpcgnn_oversubscribed; then
                # Binding to cores the machine lacks is refused ("overload-allowed"): leave ranks
                # unbound (pe=N binds, and Open MPI refuses it beside --bind-to none).
                LAUNCH+=(--bind-to none)
            elif [[ $flavour == openmpi && $cpus -gt 1 ]]; then
                LAUNCH+=(--map-by "slot:pe=$cpus")
            fi
            ;;
        *) hpcgnn_die "HPCGNN_LAUNCHER=$want is not one of auto, srun, mpirun" ;;
    esac
    # One GPU per rank (when there are GPUs), set inside each rank before python starts.
    LAUNCH+=("$HPCGNN_HOME/jobs/lib/bind.sh")
    local tasks gpus=${SLURM_GPUS_ON_NODE:-0}
    tasks=$(hpcgnn_node_tasks)
    if [[ ${HPCGNN_GPU_BIND:-1} == 1 && $gpus =~ ^[0-9]+$ && $tasks =~ ^[0-9]+$ ]] && (( gpus > tasks )); then
        hpcgnn_say "warning: the job has $gpus GPUs on this node but $tasks tasks: each rank uses one GPU, $(( gpus - tasks )) stay idle; submit with --ntasks-per-gpu=1 (or --ntasks-per-node=$gpus) for one rank per GPU"
    fi
    hpcgnn_say "launcher: ${LAUNCH[*]} (MPI: $flavour, $ntasks ranks x $cpus CPUs)"
}

# Run a command in the background and pass USR1 on to it, so that the warning signal
# (#SBATCH --signal=B:USR1@N) reaches the launcher, which forwards it to the ranks (srun,
# Open MPI's mpirun and MPICH's mpiexec all do). A TERM to this shell is passed on as USR1 too:
# srun and mpirun take TERM as "kill the ranks now", USR1 reaches the ranks, which treat both
# alike (checkpoint at the end of the epoch). Until a rank's bash has run its first line
# (jobs/lib/bind.sh: `trap '' USR1`), USR1 kills it, and so it kills a launcher that has not set
# up its own handler yet: where HPCGNN_LISTENING names a file, the signal is passed on only once
# it exists (hpcgnn train's rank 0 creates it when every rank has set up its handler) or
# HPCGNN_LISTEN_WAIT seconds (default 60) have passed. Once signalled (here, or before the
# launch: HPCGNN_SIGNALLED=1), USR1 is sent again every HPCGNN_RESIGNAL seconds (default 5)
# until the command ends; hpcgnn train ignores it again once it stops training. Returns the
# command's exit status.
hpcgnn_run_forwarding() {
    "$@" &
    local pid=$!
    HPCGNN_LAUNCHED=$SECONDS
    # shellcheck disable=SC2064
    trap "hpcgnn_pass_usr1 $pid 'got USR1'" USR1
    # shellcheck disable=SC2064
    trap "hpcgnn_pass_usr1 $pid 'got TERM' ' as USR1'" TERM
    if [[ ${HPCGNN_SIGNALLED:-0} == 1 ]]; then   # not at once: the ranks may not ignore it yet
        hpcgnn_say "got USR1 before the launch: passing it to the ranks once they listen"
        hpcgnn_resend "$pid" 0
    fi
    # A trapped signal interrupts wait (status > 128): wait again until the launcher has ended.
    while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
    local rc=0
    wait "$pid" || rc=$?  # bash keeps the status of a reaped background job
    trap '' USR1          # the ranks have ended: a late warning must not kill this script
    trap - TERM
    if [[ -n ${HPCGNN_RESENDER:-} ]]; then kill "$HPCGNN_RESENDER" 2>/dev/null || true; fi
    HPCGNN_RESENDER=""
    return $rc
}

# Do the ranks keep a USR1 now (see hpcgnn_run_forwarding)?
hpcgnn_ranks_listening() {
    [[ -z ${HPCGNN_LISTENING:-} || -e $HPCGNN_LISTENING ]] ||
        (( SECONDS - ${HPCGNN_LAUNCHED:-0} >= ${HPCGNN_LISTEN_WAIT:-60} ))
}

# The trap of hpcgnn_run_forwarding: PID is the launcher, WHAT the signal this shell got.
hpcgnn_pass_usr1() {
    local pid=$1 what=$2 as=${3:-}
    if hpcgnn_ranks_listening; then
        hpcgnn_say "$what: passing it to the ranks$as"
        kill -USR1 "$pid" 2>/dev/null
        hpcgnn_resend "$pid" 1
    else
        hpcgnn_say "$what: the ranks are not listening yet; passing it to them$as once they are"
        hpcgnn_resend "$pid" 0
    fi
}

# In the background, send USR1 to PID once the ranks listen (at once unless SENT is 1: it was
# just sent), then every HPCGNN_RESIGNAL seconds until PID ends (started once).
hpcgnn_resend() {
    [[ -z ${HPCGNN_RESENDER:-} ]] || return 0
    local pid=$1 sent=$2 every=${HPCGNN_RESIGNAL:-5}
    (
        nap=""
        trap 'kill $nap 2>/dev/null; exit 0' TERM
        while kill -0 "$pid" 2>/dev/null; do
            if ! hpcgnn_ranks_listening; then
                sleep 0.2 & nap=$!
                wait "$nap" || true
                continue
            fi
            if [[ $sent == 1 ]]; then
                sleep "$every" & nap=$!
                wait "$nap" || true
            fi
            kill -USR1 "$pid" 2>/dev/null || true
            sent=1
        done
    ) &
    HPCGNN_RESENDER=$!
}
