"""Parent of the local SLURM's daemons: reaps them (and whatever they orphan) when they end.

    python3 env/slurm/reaper.py STATUS_FILE -- bash env/slurm/up.sh --start DIR

Marks itself a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), runs the command (which
starts munged, slurmctld and slurmd in the background and exits), writes its exit status to
STATUS_FILE, then waits for every descendant that is handed to it until none is left. Without
it the daemons are orphaned when ``up.sh`` exits; in a container whose init does not reap
orphans, each daemon stopped by ``down.sh`` would stay behind as a zombie. Exits on TERM.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: reaper.py STATUS_FILE -- COMMAND...", file=sys.stderr)
        return 2
    status_file, cmd = argv[0], argv[2:]
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"[env/slurm/reaper] prctl: {os.strerror(ctypes.get_errno())}; daemons may "
              f"linger as zombies after down.sh", file=sys.stderr)
    starter = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    rc = starter.wait()
    with open(status_file + ".tmp", "w") as f:
        f.write(f"{rc}\n")
    os.replace(status_file + ".tmp", status_file)
    while True:                                   # every daemon and orphan handed to us
        try:
            os.wait()
        except ChildProcessError:
            return rc
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
