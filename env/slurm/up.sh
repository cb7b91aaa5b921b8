#!/usr/bin/env bash
# Bring up a private one-node SLURM on localhost: munged, slurmctld and slurmd, all under DIR.
#
#   eval "$(bash env/slurm/up.sh /tmp/slurm-xyz)"   # prints: export SLURM_CONF=...
#   sbatch ... ; squeue ; ...
#   bash env/slurm/down.sh /tmp/slurm-xyz           # stops them by the PIDs recorded here
#
# Run it as root (slurmd starts jobs as their owners), with the Debian/Ubuntu packages slurm-wlm
# and munge (and libpmix-dev, for srun --mpi=pmix).
# Nothing outside DIR is touched: its own munge key and socket, free TCP ports, its own
# slurm.conf. The daemons run under env/slurm/reaper.py, which reaps them when down.sh stops
# them; the PIDs go to DIR/pids/<daemon>.pid; on any failure the daemons already started are
# stopped and the logs are shown. The node declares at least 8 CPUs, more than a small machine
# has (oversubscribed, SlurmdParameters=config_overrides), so 4-rank examples run on 2 cores.
# Variables: SLURM_LOCAL_CPUS (default: the online CPUs, at least 8), SLURM_LOCAL_MEM_MB
# (default 90 % of MemTotal), SLURM_LOCAL_GPUS (stand-in GPUs, default 0), SLURM_LOCAL_TIMEOUT
# (s, default 60).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
inner=0
[[ ${1:-} == --start ]] && { inner=1; shift; }      # the part run under reaper.py
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
dir=$(mkdir -p "$1" && cd "$1" && pwd)
say() { printf '[env/slurm/up] %s\n' "$*" >&2; }

for exe in munged slurmctld slurmd sinfo; do
    command -v "$exe" >/dev/null || { say "$exe not found: install with 'apt-get install slurm-wlm munge libpmix-dev'"; exit 3; }
done
[[ $(id -u) -eq 0 ]] || { say "must run as root (slurmd starts jobs as their owners)"; exit 3; }

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

write_conf() {
    # getconf, not nproc: nproc obeys OMP_NUM_THREADS (the Makefile sets 1). At least 8 CPUs
    # (more than the cores: oversubscribed), else `sbatch --ntasks=4` on a 2-core machine
    # would pend forever (PartitionConfig)
    local online cpus
    online=$(getconf _NPROCESSORS_ONLN)
    cpus=${SLURM_LOCAL_CPUS:-$(( online > 8 ? online : 8 ))}
    local mem=${SLURM_LOCAL_MEM_MB:-$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)}
    local p1 p2
    p1=$(free_port); p2=$(free_port)
    while [[ $p2 == "$p1" ]]; do p2=$(free_port); done
    # SLURM_LOCAL_GPUS=N: the node declares N GPUs, stand-ins (character devices like
    # /dev/null) that let jobs ask for --gres=gpu:K or --gpus; nothing sees a real GPU.
    local gpus=${SLURM_LOCAL_GPUS:-0} gres="" i
    rm -f "$dir/gres.conf"
    if (( gpus > 0 )); then
        install -d "$dir/dev"
        for (( i = 0; i < gpus; i++ )); do
            [[ -e $dir/dev/gpu$i ]] || mknod "$dir/dev/gpu$i" c 1 3
        done
        echo "NodeName=localhost Name=gpu File=$dir/dev/gpu[0-$((gpus - 1))]" > "$dir/gres.conf"
        gres="Gres=gpu:$gpus "
    fi
    sed -e "s|@DIR@|$dir|g" -e "s|@CTLD_PORT@|$p1|" -e "s|@SLURMD_PORT@|$p2|" \
        -e "s|@USER@|$(id -un)|" -e "s|@CPUS@|$cpus|" -e "s|@MEM_MB@|$mem|" -e "s|@GRES@|$gres|" \
        "$here/slurm.conf.in" > "$dir/slurm.conf"
}

# start NAME CMD...: run a daemon in the foreground of its own session, record its PID.
start() {
    local name=$1; shift
    setsid "$@" > "$dir/log/$name.out" 2>&1 < /dev/null &
    echo $! > "$dir/pids/$name.pid"
}

# The key is root's alone; the socket directory is open, so users' sbatch can authenticate.
start_munge() {
    install -d -m 0700 "$dir/munge-key"
    install -d -m 0755 "$dir/munge"
    [[ -f $dir/munge-key/munge.key ]] || {
        dd if=/dev/urandom of="$dir/munge-key/munge.key" bs=1024 count=1 status=none
        chmod 0400 "$dir/munge-key/munge.key"
    }
    start munged munged --foreground --force --key-file="$dir/munge-key/munge.key" \
        --socket="$dir/munge/munge.socket" --pid-file="$dir/munge/munged.pid" \
        --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munge.seed"
    wait_for "munge socket" test -S "$dir/munge/munge.socket"
}

# wait_for WHAT CMD...: poll CMD until it succeeds or the time runs out.
wait_for() {
    local what=$1; shift
    local deadline=$((SECONDS + ${SLURM_LOCAL_TIMEOUT:-60}))
    until "$@" >/dev/null 2>&1; do
        if (( SECONDS > deadline )); then say "timed out waiting for $what"; return 1; fi
        sleep 0.5
    done
}

node_idle() { [[ $(sinfo -h -N -n localhost -o %t | sort -u) == idle ]]; }  # one line per partition

fail() {
    say "bring-up failed; logs under $dir/log:"
    tail -n 20 "$dir"/log/* >&2 || true
    bash "$here/down.sh" "$dir" >&2 || true
    exit 1
}

# The daemons must outlive this script, and be reaped when they end: start them from a child
# of reaper.py (a child subreaper that outlives this script); wait for that start to finish.
main() {
    install -d -m 0755 "$dir/state" "$dir/spool/slurmd" "$dir/log" "$dir/pids"
    local status=$dir/pids/up.status
    rm -f "$status"
    setsid python3 "$here/reaper.py" "$status" -- bash "${BASH_SOURCE[0]}" --start "$dir" \
        > "$dir/log/up.out" 2> "$dir/log/up.err" < /dev/null &
    echo $! > "$dir/pids/reaper.pid"
    local reaper=$!
    while [[ ! -f $status ]] && kill -0 "$reaper" 2>/dev/null; do sleep 0.2; done
    cat "$dir/log/up.err" >&2
    [[ -f $status ]] || { say "the start of the daemons ended without a status (see $dir/log)"; exit 1; }
    cat "$dir/log/up.out"
    return "$(cat "$status")"
}

start_daemons() {
    write_conf
    export SLURM_CONF=$dir/slurm.conf
    start_munge || fail
    start slurmctld slurmctld -D -i -f "$SLURM_CONF"
    start slurmd slurmd -D -N localhost -f "$SLURM_CONF"
    wait_for "node localhost to be idle" node_idle || fail
    say "SLURM up in $dir ($(sinfo -h -p local -o '%D node, %c CPUs, %m MB'))"
    echo "export SLURM_CONF=$SLURM_CONF"
}

if (( inner )); then start_daemons; else main; fi
