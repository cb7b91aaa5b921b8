"""A faster Triton interpreter for the kernel tests on CPUs (``TRITON_INTERPRET=1``).

The interpreter re-patches ``triton.language`` on every call of a ``@triton.jit`` helper from
inside a kernel (``InterpretedFunction.__call__`` runs ``_patch_lang``: an ``inspect.getmembers``
scan of four modules, about 1 ms), although the kernel being run (``GridExecutor.__call__``)
has already patched the same modules for its whole run and restores them at its end. Our
kernels call their helpers inside loops, so that scan was a third of the kernel tests' time.
Here a helper called while a kernel runs re-patches only on the first call from its module in
that run (``tl.zeros`` is a helper of ``triton.language.standard``, whose ``core`` the kernel's
patch does not cover), and otherwise runs the same rewritten code; anything else goes through
Triton unchanged. Where this Triton's interpreter lacks these
names, nothing is changed.
"""
from __future__ import annotations


def install() -> bool:
    """Install the shortcut; returns whether it was installed."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:                                   # no Triton, or one without an interpreter
        return False
    grid = getattr(getattr(ti, "GridExecutor", None), "__call__", None)
    func = getattr(ti, "InterpretedFunction", None)
    if grid is None or func is None or not all(hasattr(func, n) for n in ("__call__", "rewrite")) \
            or not hasattr(ti, "InterpreterError") or getattr(func, "_hpcgnn_quick", False):
        return False
    helper = func.__call__
    running: list[set] = []     # per kernel being run: ids of the module globals patched for it

    def run_kernel(self, *args, **kwargs):
        running.append(set())
        try:
            return grid(self, *args, **kwargs)
        finally:
            running.pop()

    def call_helper(self, *args, **kwargs):
        where = id(self.fn.__globals__)
        if not running or where not in running[-1]:
            if running:
                running[-1].add(where)
            return helper(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = run_kernel
    func.__call__ = call_helper
    func._hpcgnn_quick = True
    return True
