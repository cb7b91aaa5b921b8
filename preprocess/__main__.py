"""``python -m preprocess --dataset SPEC --parts K --partitioner {metis,random} --out DIR``,
``python -m preprocess verify DIR`` and ``python -m preprocess convert --dataset SPEC --out
FILE.h5``. Under ``mpirun -n P python -m mpi4py -m preprocess``, ``--partitioner ptscotch``
(any P, P = 1 too) and ``random`` (P > 1) run the distributed path (``dist_run.py``)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from hpcgnn.data.datasets import SPEC_HELP, load_dataset
from hpcgnn.data.errors import DatasetError
from hpcgnn.data.shard import ShardFormatError
from hpcgnn.log import run_command, say_error
from preprocess.errors import PreprocessError
from preprocess.partition import PARTITIONERS, check_parts, partition_graph
from preprocess.verify import verify_shards
from preprocess.write import check_out_dir, check_writable, input_stamp, write_shards

log = logging.getLogger("hpcgnn.preprocess")


def _seed(text: str) -> int:
    """``--seed``: an integer >= 0 (numpy's generators refuse a negative one)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not an integer >= 0; pass e.g. --seed 0")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m preprocess",
        description="Partition a graph and write one HDF5 shard per part (then: "
                    "`python -m preprocess verify DIR`). Also: `python -m preprocess convert "
                    "--dataset SPEC --out FILE.h5` writes a dataset as an h5: input file.")
    ap.add_argument("--dataset", required=True, help=f"dataset spec: {SPEC_HELP}")
    ap.add_argument("--parts", type=int, required=True,
                    help="number of parts K; the halo exchange trains on R ranks for any R "
                         "dividing K (CAGNET: docs/cagnet.md)")
    ap.add_argument("--partitioner", choices=PARTITIONERS + ("ptscotch",), default="metis",
                    help="metis: one process; ptscotch: PT-Scotch across the MPI ranks "
                         "(mpirun -n P python -m mpi4py -m preprocess ...); random: either")
    ap.add_argument("--out", required=True, help="output directory for meta.json + part-*.h5")
    ap.add_argument("--seed", type=_seed, default=0,
                    help="partitioner seed (a generator takes its own: csbm:...,seed=S)")
    ap.add_argument("--force", action="store_true", help="overwrite a shard set already in --out")
    ap.add_argument("--symmetrize", action="store_true",
                    help="add the reverse of every edge (for directed inputs)")
    ap.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    return ap


def _verify_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m preprocess verify",
                                 description="Re-check a shard set; exit 1 if anything is wrong.")
    ap.add_argument("dir", help="shard directory (holds meta.json)")
    ap.add_argument("-q", "--quiet", action="store_true")
    return ap


def _convert_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m preprocess convert",
                                 description="Write a dataset as an h5: input file (HDF5 with "
                                             "the npz keys; ranks read row slices of it).")
    ap.add_argument("--dataset", required=True, help=f"dataset spec: {SPEC_HELP}")
    ap.add_argument("--out", required=True, help="the .h5 file to write")
    ap.add_argument("--symmetrize", action="store_true", help="add the reverse of every edge")
    ap.add_argument("--force", action="store_true", help="replace an existing --out file")
    ap.add_argument("-q", "--quiet", action="store_true")
    return ap


def _check_convert_out(out: Path, force: bool) -> None:
    """Refuse an ``--out`` that is a directory, lies below a file, or (without ``--force``) is
    an existing file, before the long load."""
    if out.is_dir():
        raise PreprocessError(f"{out}: is a directory; --out names the .h5 file to write, e.g. "
                              f"--out {out / 'graph.h5'}")
    if out.exists() and not force:
        raise PreprocessError(f"{out}: exists; pass --force to replace it, or choose another "
                              f"--out")
    above = out.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise PreprocessError(f"{above}: exists and is not a directory, so {out} cannot be "
                              f"written; choose another --out")
    check_writable(out.parent, "--out")


def _convert(args: argparse.Namespace) -> None:
    from hpcgnn.data.h5input import write_h5
    out = Path(args.out)
    _check_convert_out(out, args.force)
    graph = load_dataset(args.dataset, symmetrize=args.symmetrize)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)      # missing folders are made
        write_h5(graph, out)                               # temporary name, then renamed
    except (OSError, RuntimeError) as exc:                 # h5py: RuntimeError on close
        raise PreprocessError(f"{out}: write failed ({exc}); check that the folder is "
                              f"writable and has space, then re-run (no file was left)") from exc
    print(f"wrote {out}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges; use "
          f"--dataset h5:{out}")


def _world():
    """MPI's world communicator when this process runs under mpi4py (else None)."""
    if "mpi4py.MPI" not in sys.modules and not any(
            k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        return None
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _run_distributed(args: argparse.Namespace, comm) -> None:
    from preprocess.dist_run import run_distributed
    t0 = time.perf_counter()
    run_distributed(comm, args.dataset, args.parts, args.partitioner, args.out, args.seed,
                    args.force, args.symmetrize)
    if comm.rank == 0:
        log.info("done on %d ranks in %.1f s; check with `python -m preprocess verify %s`",
                 comm.size, time.perf_counter() - t0, args.out)


def _run(args: argparse.Namespace) -> None:
    check_parts(args.parts)                      # --parts 0: before the input is read
    comm = _world()
    size = comm.size if comm is not None else 1
    if args.partitioner == "ptscotch" or (args.partitioner == "random" and size > 1):
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        return _run_distributed(args, comm)
    if size > 1:
        raise PreprocessError(f"--partitioner {args.partitioner} runs in one process, not on "
                              f"{size} ranks: drop mpirun, or use --partitioner ptscotch")
    t0 = time.perf_counter()
    check_out_dir(args.out, args.force)          # refuse before the long steps, not after
    stamp = input_stamp(args.dataset)             # the input as it is read, not as it is later
    graph = load_dataset(args.dataset, symmetrize=args.symmetrize)
    log.info("%s: %s nodes, %s edges, %d features, %d classes (%.1f s)", graph.name,
             f"{graph.num_nodes:,}", f"{graph.num_edges:,}", graph.feature_dim,
             graph.num_classes, time.perf_counter() - t0)
    parts = partition_graph(graph, args.parts, args.partitioner, args.seed)
    write_shards(graph, parts, args.out, partitioner=args.partitioner, seed=args.seed,
                 force=args.force, num_parts=args.parts, symmetrize=args.symmetrize,
                 stamp=stamp)
    log.info("done in %.1f s; check with `python -m preprocess verify %s`",
             time.perf_counter() - t0, args.out)


def _verify(args: argparse.Namespace) -> None:
    report = verify_shards(args.dir)
    print(f"OK {args.dir}: {report}")


def _rank_tag() -> str:
    """' (rank r of P)' when this process is one of several MPI ranks, else ''."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.size == 1:
        return ""
    return f" (rank {mpi.COMM_WORLD.rank} of {mpi.COMM_WORLD.size})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sub = argv[0] if argv and argv[0] in ("verify", "convert") else None
    parser = {"verify": _verify_parser, "convert": _convert_parser, None: _parser}[sub]()
    args = parser.parse_args(argv[1:] if sub else argv)
    verify = sub == "verify"
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s preprocess: %(message)s", datefmt="%H:%M:%S")
    try:
        {"verify": _verify, "convert": _convert, None: _run}[sub](args)
    except (DatasetError, PreprocessError, ShardFormatError) as exc:
        say_error(f"preprocess{' verify' if verify else ''}: error{_rank_tag()}: {exc}")
        return 1
    except KeyboardInterrupt:
        say_error("preprocess: interrupted; no shard set was written")
        return 130
    return 0


def cli() -> None:
    """The console script's entry (pyproject's ``[project.scripts]``): ``main`` as ``python -m``
    runs it, an escaping exception ending the whole job (``run_command``)."""
    run_command(main)


if __name__ == "__main__":
    cli()
