#!/usr/bin/env bash
# The GPU machine's runs. Build the wheels it lacks first (`make device-wheels`, into .whl/) and
# carry them (`carry [".whl"]`); each run fits the device tool's 10-minute call:
#   bash bench/device_run.sh wheels    install .whl/, say what the machine has (GPUs, CPUs, versions)
#   bash bench/device_run.sh tests     the GPU tests (tests/gpu), their log in $OUT/gpu-tests.log
#   bash bench/device_run.sh attach    bench_attach on cuda:0: 1k, 10k and 100k tensors (16, 16, 1.6 GB)
#   bash bench/device_run.sh load      bench_load on cuda:0: 1.6 GB / 1k and 100k tensors warm against every
#                                      peer, then 1.6 GB / 1k cold against fastsafetensors, five rounds
#   bash bench/device_run.sh restart   bench_restart: exec -> READY with 0.1 GB / 200 and 1.6 GB / 100k kept,
#                                      on cuda:0 and on the host
#   bash bench/device_run.sh admit     bench_admit at 1.6 GB / 1k and 100k tensors, 8 header helpers
#   bash bench/device_run.sh refit     bench_refit: 16 GB / 1k tensors, 4 engines (in place, copy-in, ipc, floor),
#                                      then 64 GB in place (`--source arena`: no room for the trainer's copy)
#   bash bench/device_run.sh all       tests, restart, admit, attach (1k, 100k) and load (wcd and fastsafetensors),
#                                      fewer rounds: all in one call
# Arguments after the run's name go to its benchmarks (`load --variant default,buffered`).
# What comes back ($OUT, at most 8 files): run.log (everything printed), gpu-tests.log, NAME.json
# per benchmark (load-warm, load-cold, restart: cuda:0 and cpu rows) and load-daemon.log (the cold
# loads' daemon log at debug level; other variants' logs beside it would pass the 8).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/wcd-device-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
if ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "no wheels in .whl/: run \`make device-wheels\` here first and carry .whl"; exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m compileall -q wcd bench /tmp/site >/dev/null  # as an installed package has: no compiling on the clock
DATA=/tmp/wcd-bench-load  # checkpoints, written once per machine
DEV=${WCD_BENCH_DEVICE:-cuda:0}  # cpu: the same runs with host arenas (a dry run off the GPU machine)
PEERS=safetensors,fastsafetensors,instanttensor,runai

wheels() {
  nvidia-smi -L; echo "$(nproc) CPUs, $(free -g | awk '/Mem:/ {print $2}') GiB"; uname -r
  python3 -c "import sys, importlib.metadata as m, torch
def v(name):
    try: return m.version(name)
    except m.PackageNotFoundError: return 'missing'
print('Python', sys.version.split()[0], 'torch', torch.__version__, 'GPUs', torch.cuda.device_count(),
      *(f'{n} {v(n)}' for n in ('cuda-bindings', 'pydantic', 'msgpack', 'uvloop', 'fastsafetensors')))"
  python3 -m wcd --version
}

tests() {
  timeout "${1:-240}" python3 -m pytest tests/gpu -q -rA -p no:cacheprovider >"$OUT/gpu-tests.log" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu-tests.log" | cut -c1-300
}

attach() {  # [timeout [counts sizes [reps]]]
  local t=${1:-400} counts=${2:-1000,10000,100000} sizes=${3:-16000,16000,1600} reps=${4:-3}
  timeout -s INT "$t" python3 bench/bench_attach.py --device "$DEV" --dir /tmp --counts "$counts" \
    --sizes-mb "$sizes" --reps "$reps" --json "$OUT/attach.json" ${EXTRA[@]+"${EXTRA[@]}"} | grep -v '^{'
}

load() {  # [timeout [cold rounds [warm loaders]]]
  local t=${1:-500} rounds=${2:-5} loaders=${3:-wcd,$PEERS}
  timeout -s INT "$((t / 2))" python3 bench/bench_load.py --device "$DEV" --dir "$DATA" --ckpt 1.6:1000 \
    --ckpt 1.6:100000 --reps 2 --loaders "$loaders" --json "$OUT/load-warm.json" ${EXTRA[@]+"${EXTRA[@]}"}
  timeout -s INT "$((t / 2))" python3 bench/bench_load.py --device "$DEV" --dir "$DATA" --ckpt 1.6:1000 --cold \
    --cold-reps "$rounds" --reps 1 --loaders wcd,fastsafetensors --log-level debug \
    --daemon-log "$OUT/load-daemon.log" --json "$OUT/load-cold.json" ${EXTRA[@]+"${EXTRA[@]}"}
}

restart() {  # [timeout]
  local t=${1:-200}
  timeout "$t" python3 bench/bench_restart.py --device "$(echo "$DEV,cpu" | sed 's/^cpu,cpu$/cpu/')" --dir "$DATA" \
    --ckpt 0.1:200 --ckpt 1.6:100000 --restarts 3 --json "$OUT/restart.json" ${EXTRA[@]+"${EXTRA[@]}"} \
    | python3 -c "import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r['device'], r['variant'], [round(x, 3) for x in r['exec_to_ready_s']],
                               [round(x, 3) for x in r['exec_to_served_s']], r['daemon_says'][-1][:160])"
}

admit() {  # [timeout]
  local t=${1:-150}
  timeout "$t" python3 bench/bench_admit.py --dir "$DATA" --ckpt 1.6:1000 --ckpt 1.6:100000 --reps 5 --helpers 8 \
    --json "$OUT/admit.json" ${EXTRA[@]+"${EXTRA[@]}"}
}

refit() {  # [timeout]
  local t=${1:-300}
  timeout -s INT "$((t / 2))" python3 bench/bench_refit.py --device "$DEV" --gb 16 --tensors 1000 --engines 4 --json \
    ${EXTRA[@]+"${EXTRA[@]}"} | tee "$OUT/refit-16.json"
  timeout -s INT "$((t / 2))" python3 bench/bench_refit.py --device "$DEV" --gb 64 --tensors 1000 --engines 4 \
    --modes in_place --source arena --json ${EXTRA[@]+"${EXTRA[@]}"} | tee "$OUT/refit-64.json"
}

run=${1:-tests}; shift || true
EXTRA=("$@")
case "$run" in
  wheels) wheels ;;
  tests|attach|load|restart|admit|refit) wheels; "$run" ;;
  all)
    wheels
    tests 120
    restart 80
    admit 60
    attach 130 1000,100000 16000,1600 2
    load 170 3 wcd,fastsafetensors ;;
  *) echo "unknown run $run; one of: wheels tests attach load restart admit refit all"; exit 2 ;;
esac
