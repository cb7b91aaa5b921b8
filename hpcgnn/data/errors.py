"""The one error a dataset reader raises for input a user can fix."""
from __future__ import annotations


class DatasetError(ValueError):
    """A dataset that is missing, malformed or out of range; the message names file and fix."""


H5_ERRORS = (OSError, KeyError, RuntimeError, TypeError, ValueError)
"""What h5py raises reading a damaged file: OSError, KeyError (a damaged link), RuntimeError
('bad local heap signature', 'actual len exceeds EOA'), TypeError and ValueError (a damaged
name, type or shape). A reader that raises its own ValueError subclass inside the ``try``
re-raises it before catching these."""


LOCK_FIX = ("HDF5 could not lock the file: another program has it open for writing, or the file "
            "system refuses locks (as NFS and some Lustre mounts do); close that program, or set "
            "HDF5_USE_FILE_LOCKING=FALSE in the job's environment (env/site.sh)")


def hdf5_fix(exc: BaseException, fix: str) -> str:
    """The fix to name for an error ``exc`` of opening or reading an HDF5 file: ``fix``, unless
    HDF5 refused the file's lock (rewriting the file would not help then)."""
    return LOCK_FIX if "unable to lock file" in str(exc) else fix
