#!/usr/bin/env bash
# Stop the one-node SLURM that env/slurm/up.sh started under DIR: cancel its jobs, then end
# slurmd, slurmctld and munged by the PIDs recorded in DIR/pids (TERM, then KILL after 10 s);
# their parent, env/slurm/reaper.py, reaps them and then ends (TERM if it has not after 10 s).
# A PID is only signalled while its command line still names DIR, so a reused PID is left alone.
set -uo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
dir=$(cd "$1" 2>/dev/null && pwd) || { echo "[env/slurm/down] no such dir: $1" >&2; exit 0; }
say() { printf '[env/slurm/down] %s\n' "$*" >&2; }

ours() {  # ours PID: the process is alive (not a zombie) and was started with a path under $dir
    [[ -r /proc/$1/cmdline ]] && tr '\0' ' ' < "/proc/$1/cmdline" 2>/dev/null | grep -qF "$dir"
}

wait_gone() {  # wait_gone PID: until it has ended (and been reaped), at most 10 s
    for _ in $(seq 1 100); do ours "$1" || return 0; sleep 0.1; done
    return 1
}

stop() {
    local name=$1 file=$dir/pids/$1.pid pid
    [[ -f $file ]] || return 0
    pid=$(cat "$file")
    if ours "$pid"; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 1 100); do ours "$pid" || break; sleep 0.1; done
        ours "$pid" && { say "$name ($pid) ignored TERM; sending KILL"; kill -KILL "$pid" 2>/dev/null; }
        say "stopped $name ($pid)"
    fi
    rm -f "$file"
}

cancel_jobs() {
    [[ -f $dir/slurm.conf && -f $dir/pids/slurmctld.pid ]] || return 0
    export SLURM_CONF=$dir/slurm.conf
    timeout 10 scancel --full --quiet --partition=local 2>/dev/null || return 0
    for _ in $(seq 1 30); do
        [[ -z $(timeout 5 squeue -h -t running,completing -o %i 2>/dev/null) ]] && return 0
        sleep 0.5
    done
    say "jobs still running after 15 s; stopping the daemons anyway"
}

cancel_jobs
stop slurmd
stop slurmctld
stop munged
reaper=$(cat "$dir/pids/reaper.pid" 2>/dev/null || true)
if [[ -n $reaper ]] && ! wait_gone "$reaper"; then stop reaper; fi
rm -f "$dir/pids/reaper.pid" "$dir/pids/up.status"
