"""``python -m preprocess --dataset SPEC --parts K --partitioner {metis,random} --out DIR``
and ``python -m preprocess verify DIR``."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from hpcgnn.data.datasets import SPEC_HELP, load_dataset
from hpcgnn.data.errors import DatasetError
from hpcgnn.data.shard import ShardFormatError
from preprocess.errors import PreprocessError
from preprocess.partition import PARTITIONERS, partition_graph
from preprocess.verify import verify_shards
from preprocess.write import check_out_dir, write_shards

log = logging.getLogger("hpcgnn.preprocess")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m preprocess",
        description="Partition a graph and write one HDF5 shard per rank (then: "
                    "`python -m preprocess verify DIR`).")
    ap.add_argument("--dataset", required=True, help=f"dataset spec: {SPEC_HELP}")
    ap.add_argument("--parts", type=int, required=True, help="number of parts (= MPI ranks)")
    ap.add_argument("--partitioner", choices=PARTITIONERS, default="metis")
    ap.add_argument("--out", required=True, help="output directory for meta.json + part-*.h5")
    ap.add_argument("--seed", type=int, default=0,
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


def _run(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    check_out_dir(args.out, args.force)          # refuse before the long steps, not after
    graph = load_dataset(args.dataset, symmetrize=args.symmetrize)
    log.info("%s: %s nodes, %s edges, %d features, %d classes (%.1f s)", graph.name,
             f"{graph.num_nodes:,}", f"{graph.num_edges:,}", graph.feature_dim,
             graph.num_classes, time.perf_counter() - t0)
    parts = partition_graph(graph, args.parts, args.partitioner, args.seed)
    write_shards(graph, parts, args.out, partitioner=args.partitioner, seed=args.seed,
                 force=args.force, num_parts=args.parts)
    log.info("done in %.1f s; check with `python -m preprocess verify %s`",
             time.perf_counter() - t0, args.out)


def _verify(args: argparse.Namespace) -> None:
    report = verify_shards(args.dir)
    print(f"OK {args.dir}: {report}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verify = bool(argv) and argv[0] == "verify"
    args = (_verify_parser() if verify else _parser()).parse_args(argv[1:] if verify else argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s preprocess: %(message)s", datefmt="%H:%M:%S")
    try:
        _verify(args) if verify else _run(args)
    except (DatasetError, PreprocessError, ShardFormatError) as exc:
        print(f"preprocess{' verify' if verify else ''}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("preprocess: interrupted; no shard set was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
