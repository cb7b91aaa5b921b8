#!/usr/bin/env bash
# The timed benchmarks, in sequence, on the idle machine.
set -x
cd "$(dirname "$0")/.."
PY=.venv/bin/python
date; uptime
OMP_NUM_THREADS=1 $PY bench/codecs.py --repeat 5 --out bench/results/codecs
date; uptime
$PY bench/network.py --ranks 4 --rates 0.5 1 10 shm --schedules floor full varco varco-quant2-all quant4-all quant2-all quant1-all sample-all sample-quant2-all full@s1 full@s1m full@s2 quant1-all@s1 quant1-all@s1m --epochs 100 --out bench/results/network --plot
date; uptime
$PY bench/network.py --ranks 8 --rates 1 shm --schedules floor full varco quant2-all quant1-all sample-quant2-all full@s1 quant1-all@s1 --epochs 100 --out bench/results/network --plot --append
date; uptime
SBM="csbm:nodes=20000,classes=8,degree=10,homophily=0.7,features=128,signal=0.8,seed=11"
$PY bench/network.py --dataset "$SBM" --partitioner metis --ranks 4 8 16 --rates 1 shm --schedules full full@1.5d-c1 full@1.5d-c2 full@1.5d-c4 --epochs 8 --work runs/cagnet-metis --out bench/results/cagnet-sbm-metis
date; uptime
$PY bench/network.py --dataset "$SBM" --partitioner random --ranks 4 8 16 --rates 1 --schedules full full@1.5d-c1 full@1.5d-c2 full@1.5d-c4 --epochs 8 --work runs/cagnet-random --out bench/results/cagnet-sbm-random
date; uptime
$PY bench/network.py --dataset "rmat:scale=14,features=128,classes=8,seed=1" --partitioner random --ranks 8 16 --rates 1 --schedules full full@1.5d-c1 full@1.5d-c2 full@1.5d-c4 --epochs 8 --work runs/cagnet-rmat --out bench/results/cagnet-rmat-random
date; uptime
echo TIMING-DONE
