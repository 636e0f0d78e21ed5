#!/bin/bash
# usage: bash benchmarks/gpu_runs.sh RUNS   (RUNS: lines "slug<TAB>fsd cl arguments")
# One GPU session's work in one call: tests/test_cuda.py beside continual-learning runs that
# share the GPU (one process per seed, under MPS), stopped at STOP seconds; what finished
# (results.json, results.md, fsd cl gap) and every log come back in $OUT/runs.tgz.
# Needs MNIST under .devdata/mnist (copy of the data directory's mnist/, git-ignored and
# carried). Dry run on a CPU:
#   DEV=cpu EXTRA="--train-subset 64 --test-subset 32 --epochs 1 --tasks 2" STOP=200 \
#     PY=.venv/bin/python OUT=dry-run bash benchmarks/gpu_runs.sh RUNS
# Measured on an H200 (12 runs + the tests, 2026-11-28): Split MNIST bgln-d 3.3 min per seed,
# bgln-d-exact 5.2; Permuted MNIST (width 512) bgln-d ~60 s per task, bgln-s 20-100 s per task
# growing with the task count, so a 10-task Permuted seed does not fit one 10-minute call.
set -u
START=$(date +%s)
DEV=${DEV:-cuda}; EXTRA=${EXTRA:-}; STOP=${STOP:-490}; PY=${PY:-python3}
W=$(mktemp -d)  # the runs, their logs and checkpoints
OUTDIR=$(realpath -m "${OUT:-$W/out}"); mkdir -p "$OUTDIR"
D=$PWD/.devdata
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FSD_NO_DOWNLOAD=1 OMP_NUM_THREADS=1 FSD_DATA_DIR=$D
if [ "$DEV" = cuda ]; then
  nvidia-smi -L; $PY -c "import torch;print(torch.__version__, torch.cuda.get_device_name())"
  export CUDA_MPS_PIPE_DIRECTORY=$W/mps CUDA_MPS_LOG_DIRECTORY=$W/mpslog
  mkdir -p $W/mps $W/mpslog; nvidia-cuda-mps-control -d && echo "MPS on" || echo "MPS off"
fi
run() {  # slug benchmark args...
  slug=$1; shift
  ( s=$(date +%s); $PY -m fsd_experiments cl "$@" --device $DEV --threads 1 --no-progress $EXTRA --data-dir $D --out $W/$slug > $W/$slug.log 2>&1
    echo "train rc=$? $(( $(date +%s) - s )) s" >> $W/$slug.log
    $PY -m fsd_experiments cl gap $W/$slug --data-dir $D --threads 1 > $W/$slug.gap 2>>$W/$slug.log && cp $W/$slug.gap $W/$slug/gap.md
    echo "gap done $(( $(date +%s) - s )) s" >> $W/$slug.log ) &
}
while IFS=$'\t' read -r slug args; do  # RUNS: one run a line, "slug<TAB>fsd cl arguments"
  [ -n "$slug" ] && run $slug $args
done < "$1"
( $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py > $OUTDIR/pytest.log 2>&1; echo "pytest rc=$? at $(( $(date +%s) - START )) s" >> $OUTDIR/pytest.log ) &
PT=$!
while [ $(( $(date +%s) - START )) -lt $STOP ]; do
  sleep 10
  [ -z "$(jobs -rp | grep -v "^$PT$")" ] && ! kill -0 $PT 2>/dev/null && break
done
echo "stopping at $(( $(date +%s) - START )) s"; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv 2>/dev/null
pkill -f "fsd_experiments cl" ; sleep 2
cd $W && for d in */; do d=${d%/}; [ -d $d/checkpoints ] && ls $d/checkpoints | tr '\n' ' ' >> $d.log; done
tar czf $OUTDIR/runs.tgz --exclude=checkpoints --exclude='*.png' --exclude=./out --exclude=./mps \
  --exclude=./mpslog . ; ls -la $OUTDIR; tail -3 $OUTDIR/pytest.log
for f in *.log; do echo "== $f"; grep -E "task|rc=|gap done|Error" $f | tail -4; done
