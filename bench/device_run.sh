#!/usr/bin/env bash
# The device-machine session in two calls (each under the 10-minute limit), with `carry [".whl"]`:
#   bash bench/device_run.sh tests    GPU tests + multi-GPU run (needs 2+ GPUs for the latter)
#   bash bench/device_run.sh bench    the 32 GB side-by-side benchmark
#   bash bench/device_run.sh attach   attach benchmark (1k/10k/100k tensors), GPU tests, plugin bind
#   bash bench/device_run.sh probe    load probe (fixed costs, warm/cold sweeps, hashes), restart, peers
#   bash bench/device_run.sh final    GPU tests, fixed costs, restart, 16 GB load benchmark (all loaders, warm and cold)
#   bash bench/device_run.sh small    1.6 GB load benchmarks, 1,000 and 100,000 tensors
#   bash bench/device_run.sh check    GPU tests, fixed costs, a wcd-only 16 GB load, restart
#   bash bench/device_run.sh cold     cold read policies through the writer; wcd against two peers
#   bash bench/device_run.sh round3   GPU tests, 1.6 GB loads (all loaders), 16 GB warm and cold, restart
#   bash bench/device_run.sh explore      NUMA and disk layout, probe warm/mapped/cold, wcd beside fastsafetensors
#   bash bench/device_run.sh diag         the warm fill and the op taken apart; 1.6 GB cold beside fastsafetensors
#   bash bench/device_run.sh sweep        staging sizes (bare loop), cold reads with WILLNEED, the 1.6 GB cold op's parts
#   bash bench/device_run.sh round4       GPU tests; 1.6 GB runs (1k and 100k tensors), five loaders, warm and cold
#   bash bench/device_run.sh streams      cold reads as per-file sequential streams against 16 x 16 MiB
#   bash bench/device_run.sh order        GPU tests; 1.6 GB cold, fastsafetensors and wcd in both orders
#   bash bench/device_run.sh regress [GB]  warm loads of oldtree/ (an older revision) against this tree's
#   bash bench/device_run.sh round5   GPU tests; restart (oldtree/ and this tree, GPU and host, 16 + 64 GB kept);
#                                     cold 1.6 GB in both orders; the header parse at 100k; a context's memory
#   bash bench/device_run.sh round5c  GPU tests; the 1.6 GB table (1k and 100k tensors, five loaders, warm and
#                                     cold); bench_admit's phases and parse floor at 100k
#   bash bench/device_run.sh front    cold read patterns on 1.6 GB (fastsafetensors' 16 x 512 KiB O_DIRECT front and
#                                     neighbours), then fastsafetensors and wcd cold
#   bash bench/device_run.sh round6b  GPU tests; 64 shards at 100k: bench_admit, warm loads with and without helpers;
#                                     restart A/B against oldtree/
#   bash bench/device_run.sh round6   GPU tests; the helpers A/B three times; restart with a 100k entry kept
#   bash bench/device_run.sh verify   GPU tests; verify/digest passes at 1k and 100k tensors, 16/8/4/2 threads
#   bash bench/device_run.sh idle9    does the disk read faster after an idle spell? (disk_idle, O_DIRECT and
#                                     buffered); 1.6 GB cold, wcd and fastsafetensors, settled 0 s and 8 s; host cold
#                                     (its RESULTS row ran before every loader's clock started alike: af1ac32)
#   (ahead9, at 1cf38d8: read patterns as streams; the read-ahead A/B, since reverted; see RESULTS)
#   bash bench/device_run.sh ahead10  GPU tests; 1.6 GB / 1k cold, six rounds with staging_linger_s = 0 (a context made per
#                                     load): wcd (reading ahead in 512 KiB WILLNEEDs), wcd-noahead, fastsafetensors; five
#                                     with the default linger: wcd, wcd-direct-sweep at 512 KiB (fastsafetensors' requests;
#                                     when it ran, before dd2b441, the reads were 4 MiB), fastsafetensors
#   bash bench/device_run.sh round12b 1.6 GB / 1k cold, six rounds: wcd, wcd-direct-sweep in O_DIRECT spans of at most
#                                     512 KiB, wcd-direct-512k (the same spans, ops as usual), fastsafetensors; 16 GB /
#                                     1k cold, two rounds: wcd and fastsafetensors
#   bash bench/device_run.sh round20  1.6 GB / 1k cold with a context made per load (staging_linger_s = 0), six rounds:
#                                     256 MiB read ahead while the writer is made against 128 (it ran at 35809ab as
#                                     wcd-ahead256 against wcd; 256 is the default since, 128 wcd-ahead128)
#   bash bench/device_run.sh round19  GPU tests; cold, the default against fastsafetensors: 1.6 GB / 1k six rounds,
#                                     16 GB / 1k three
#   bash bench/device_run.sh round18  (ran at b2a9445; its variants went with that code) GPU tests; cold, Linux AIO with
#                                     two O_DIRECT reads in flight per loader thread ("wcd" then) against wcd-aio4 (four),
#                                     wcd-preadv (one blocking preadv at a time: the default before and after) and
#                                     fastsafetensors: 1.6 GB / 1k five rounds; 16 GB / 1k two, without wcd-aio4
#   bash bench/device_run.sh round17  GPU tests (first run of the code after 10e6a00: a cold small-tensor load beside a
#                                     pinging client, O_DIRECT refusals, read-ahead ranges); cold, the default (a held
#                                     event query before each wait) against wcd-sync (always waits), wcd-buffered and
#                                     fastsafetensors: 1.6 GB / 1k five rounds; 100k three, without wcd-sync
#   bash bench/device_run.sh round16  GPU tests; 1.6 GB / 1k cold with a context made per load (staging_linger_s = 0), four
#                                     rounds: wcd against wcd-noahead (at 10e6a00, where O_DIRECT loads read ahead while the
#                                     writer was made, those ops from the page cache, as now)
#   bash bench/device_run.sh round15  GPU tests; cold, the new default (O_DIRECT in 512 KiB reads, copies keeping the GIL)
#                                     against the old (wcd-buffered) and fastsafetensors: 1.6 GB / 1k five rounds, 16 GB two
#   bash bench/device_run.sh round14  1.6 GB / 1k cold, five rounds: wcd, wcd-direct-tiled and its GIL-keeping, 1 MiB and
#                                     24-thread forms, fastsafetensors; 16 GB / 1k warm and cold (two rounds): wcd, wcd-held,
#                                     wcd-direct-tiled-held, fastsafetensors
#   bash bench/device_run.sh round13  GPU tests; 1.6 GB / 1k cold, six rounds: wcd, wcd-direct-tiled (16 MiB ops in
#                                     512 KiB O_DIRECT reads), wcd-direct-512k, fastsafetensors, with the writer's
#                                     debug line (its threads' seconds in reads and in waits for copies)
#   bash bench/device_run.sh round12c 16 GB / 1k cold, three more rounds: wcd and fastsafetensors
#   bash bench/device_run.sh probe12  1.6 GB / 1k cold: read patterns, six rounds rotated (wcd's buffered sweep;
#                                     fastsafetensors' four O_DIRECT streams of 16 MiB reads into 4 KiB and huge
#                                     pages; O_DIRECT sweeps), with the disk queue's limits; then wcd and fastsafetensors
#   bash bench/device_run.sh round12  GPU tests; 1.6 GB / 1k cold, six rounds: wcd, wcd-direct-sweep: 512 KiB O_DIRECT reads, one per op (fastsafetensors'
#                                     request size, now really), fastsafetensors; 1.6 GB in 16 tensors of 100 MB cold, five
#                                     rounds: wcd, wcd-chunk16 (large tensors in 16 MiB ops: a sweep), fastsafetensors
#   bash bench/device_run.sh round11  GPU tests; 1.6 GB / 1k cold: five rounds with staging_linger_s = 0 (the context released
#                                     after the answer), wcd and fastsafetensors; six at the default linger: wcd,
#                                     wcd-direct-sweep at 512 KiB (4 MiB when it ran, before dd2b441), fastsafetensors
#   bash bench/device_run.sh cold9    1.6 GB / 1k cold, wcd and fastsafetensors, each process with torch and CUDA up
#                                     before its clock; six rounds rotated, settled 0 s and 8 s after each drop
#   bash bench/device_run.sh sweep9   GPU tests; 1.6 GB / 1k cold: read patterns (16 MiB and 4 MiB buffered, 512 KiB and 4 MiB
#                                     O_DIRECT), then wcd in 16 and 4 MiB reads (buffered, direct) and fastsafetensors
#   bash bench/device_run.sh table9   GPU tests; the 1.6 GB table (1k and 100k tensors, five loaders, warm and cold),
#                                     every loader's process with torch and CUDA up before its clock
#   bash bench/device_run.sh round8d  GPU tests; trace_admit with 8 and 12 helpers; loads A/B against oldtree/
#   bash bench/device_run.sh cold8    1.6 GB cold, four loaders, three rounds in rotated order
#   bash bench/device_run.sh table8   the 1.6 GB table (1k and 100k tensors, five loaders, warm and cold)
#   bash bench/device_run.sh round8c  GPU tests; pieces per helper swept; loads A/B against oldtree/; round8b
#   bash bench/device_run.sh round8b [N]  cold 1.6 GB: fastsafetensors, wcd with its context up, wcd without (N rounds)
#   bash bench/device_run.sh round8   GPU tests; the 100k admission with 8 helpers in time; loads A/B against oldtree/
#   bash bench/device_run.sh round7c  GPU tests; raw headers through a memfd, cheaper checks: loads A/B/C against
#                                     oldtree/ (ddca013) and oldtree2/ (557f1c6), three rounds
#   bash bench/device_run.sh round7b  GPU tests; helpers' next batch before the answer's unpacking: loads A/B against
#                                     oldtree/, three rounds; 16 GB warm; restart with a 100k entry kept
#   bash bench/device_run.sh round7   GPU tests; 8 helpers and pieces of shards: 1.6 GB 1k/100k warm loads against
#                                     oldtree/ (alternated, three rounds); restart A/B
#   bash bench/device_run.sh helpers [N]  bench_admit with header helpers; 1.6 GB warm loads with and without them
#   bash bench/device_run.sh round5b  GPU tests; restart (oldtree/ compiled, and this tree); cold 1.6 GB with 4/8/16
#                                     load workers beside fastsafetensors; 1.6 GB warm 1k/100k; 16 GB warm
# Logs and JSON land in $OUT (the device tool brings them back).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/wcd-device-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m compileall -q wcd /tmp/site >/dev/null  # as an installed package has: no compiling on the clock
nvidia-smi -L | tee "$OUT/gpus.txt"; nproc; free -g | head -2
LOADERS=wcd,wcd-direct,safetensors,fastsafetensors,instanttensor,runai  # wcd-direct: cold_reads = "direct"
restart_ab() {  # the 0.1 GB and 1.6 GB checkpoints (written once), then exec -> READY of oldtree/ and this
  # tree, alternated, on a GPU and a host-only config: a line per run (JSON in $OUT/logs)
  mkdir -p "$OUT/logs"
  python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_load import write_checkpoint
write_checkpoint(Path('/tmp/wcd-bench-load/0.1gb-200'), int(0.1e9), 200, 1)
write_checkpoint(Path('/tmp/wcd-bench-load/1.6gb-1000'), int(1.6e9), 1000, 4)
write_checkpoint(Path('/tmp/wcd-bench-load/1.6gb-100000'), int(1.6e9), 100000, 4)" >&2
  for round in 1 2 3; do for dev in cuda:0 cpu; do for t in old new; do
    R=$PWD; [ $t = old ] && R=$PWD/oldtree
    (cd "$R" && PYTHONPATH=/tmp/site:$R timeout 60 python3 bench/bench_restart.py --device $dev \
      --ckpt /tmp/wcd-bench-load/0.1gb-200 --restarts 5 > "$OUT/logs/restart-$t-${dev%%:*}-$round.json" \
      2>"$OUT/logs/restart-err.log")
    echo "$t $dev $round $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([round(x,3) for x in d['exec_to_ready_s']], d['daemon_says'][-1][:150])" "$OUT/logs/restart-$t-${dev%%:*}-$round.json" 2>&1)"
  done; done; done
}
round7_ab() {  # GPU tests, bench_admit with 8 helpers, then 1.6 GB 1k/100k warm loads of each variant
  # ("name=tree[:daemon config line]", trees byte-compiled here), alternated, three rounds, into $OUT/logs
  timeout 150 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
    | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
  timeout 120 python3 bench/bench_admit.py --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --ckpt 1.6:100000 --reps 7 \
    --helpers 8 2>&1 | tee "$OUT/admit.txt" | tail -3
  mkdir -p "$OUT/logs"
  for round in 1 2 3; do for spec in $1; do
    v=${spec%%=*}; where=${spec#*=}; tree=${where%%:*}; cfg=""
    [ "$where" != "$tree" ] && cfg=$(echo "${where#*:}" | tr '=' ' ' | sed 's/ / = /')
    R=$PWD/$tree; python3 -m compileall -q "$R/wcd" >/dev/null
    (cd "$R" && PYTHONPATH=/tmp/site:$R BENCH_DAEMON_CONFIG="$cfg" BENCH_DAEMON_LOG_LEVEL=debug timeout 150 \
      python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --ckpt 1.6:100000 \
      --reps 3 --loaders wcd --out "$OUT/logs/load-$v-$round.json" --daemon-log "$OUT/logs/daemon-$v-$round.log" 2>&1 \
      | grep -v '"wcd_verify"' | sed "s/^/$v $round /" | cut -c1-260)
  done; done
  grep -hE "admitting b1|filled from .*100000" "$OUT"/logs/daemon-new-*.log | cut -c1-200
}
gpu_tests() {  # the GPU tests, their log in $OUT
  timeout 150 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
    | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
}
cold_load() {  # NAME TIMEOUT GB:TENSORS ROUNDS LOADERS: a cold bench_load run (NAME.json, NAME-daemon.log at
  # debug level in $OUT), its rounds' lines and its summary; environment set before the call reaches it
  BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT "$2" python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
    --ckpt "$3" --cold --cold-reps "$4" --reps 1 --loaders "$5" --out "$OUT/$1.json" \
    --daemon-log "$OUT/$1-daemon.log" 2>&1 | grep '"round"' | cut -c1-200
  python3 bench/summarize_load.py "$OUT/$1.json" | cut -c1-300
}
cold_settled() {  # ROUNDS TIMEOUT PREFIX: 1.6 GB / 1k cold, wcd and fastsafetensors, settled 0 s and 8 s after each drop
  for settle in 0 8; do
    BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT "$2" python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --cold --cold-reps "$1" --reps 1 --settle $settle --loaders wcd,fastsafetensors \
      --out "$OUT/${3}load-settle$settle.json" --daemon-log "$OUT/${3}daemon-settle$settle.log" 2>&1 \
      | grep '"round"' | cut -c1-330
    grep -E "filled from" "$OUT/${3}daemon-settle$settle.log" | cut -c1-200
  done
}
case "${1:-tests}" in
  ahead10)
    gpu_tests
    BENCH_DAEMON_CONFIG="staging_linger_s = 0" BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 250 python3 bench/bench_load.py \
      --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --cold --cold-reps 6 --reps 1 \
      --loaders wcd,wcd-noahead,fastsafetensors --out "$OUT/ahead10-linger0.json" \
      --daemon-log "$OUT/ahead10-daemon-linger0.log" 2>&1 | grep '"round"' | cut -c1-300
    BENCH_SWEEP_BYTES=524288 BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 230 python3 bench/bench_load.py \
      --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --cold --cold-reps 5 --reps 1 \
      --loaders wcd,wcd-direct-sweep,fastsafetensors --out "$OUT/ahead10-linger.json" \
      --daemon-log "$OUT/ahead10-daemon-linger.log" 2>&1 | grep '"round"' | cut -c1-300
    grep -h "filled from" "$OUT"/ahead10-daemon*.log | cut -c1-200 ;;
  round12b)
    BENCH_SWEEP_BYTES=520192 cold_load round12b-1k 260 1.6:1000 6 wcd,wcd-direct-sweep,wcd-direct-512k,fastsafetensors
    rm -rf /tmp/wcd-bench-load/1.6gb-*
    cold_load round12b-16gb 230 16:1000 2 wcd,fastsafetensors ;;
  round20)
    BENCH_DAEMON_CONFIG="staging_linger_s = 0" cold_load round20-linger0 200 1.6:1000 6 wcd-ahead128,wcd
    grep -h "filled from" "$OUT"/round20-*daemon*.log | cut -c1-160 ;;
  round19)
    gpu_tests
    cold_load round19-1k 200 1.6:1000 6 wcd,fastsafetensors
    rm -rf /tmp/wcd-bench-load/1.6gb-1000
    cold_load round19-16gb 260 16:1000 3 wcd,fastsafetensors ;;
  round18)
    gpu_tests
    cold_load round18-1k 240 1.6:1000 5 wcd,wcd-aio4,wcd-preadv,fastsafetensors
    grep -h "CUDA writer:" "$OUT"/round18-1k*daemon*.log | cut -c1-120
    rm -rf /tmp/wcd-bench-load/1.6gb-1000
    cold_load round18-16gb 240 16:1000 2 wcd,wcd-preadv,fastsafetensors
    rm -f "$OUT/gpus.txt" ;;  # eight files: the tests' log, two JSON, five daemon logs
  round17)
    gpu_tests
    cold_load round17-1k 240 1.6:1000 5 wcd,wcd-sync,wcd-buffered,fastsafetensors
    grep -h "CUDA writer:" "$OUT"/round17-1k*daemon*.log | cut -c1-120
    rm -rf /tmp/wcd-bench-load/1.6gb-1000
    cold_load round17-100k 170 1.6:100000 3 wcd,wcd-buffered,fastsafetensors
    rm -f "$OUT/gpus.txt" ;;  # eight files: the tests' log, two JSON, five daemon logs
  round16)
    gpu_tests
    BENCH_DAEMON_CONFIG="staging_linger_s = 0" cold_load round16-linger0 150 1.6:1000 4 wcd,wcd-noahead
    grep -h "filled from" "$OUT"/round16-*daemon*.log | cut -c1-160 ;;
  round15)
    gpu_tests
    cold_load round15-1k 200 1.6:1000 5 wcd,wcd-buffered,fastsafetensors
    grep -h "CUDA writer:" "$OUT"/round15-1k*daemon*.log | cut -c1-120
    rm -rf /tmp/wcd-bench-load/1.6gb-*
    cold_load round15-16gb 230 16:1000 2 wcd,wcd-buffered,fastsafetensors ;;
  round14)
    cold_load round14-1k 330 1.6:1000 5 \
      wcd,wcd-direct-tiled,wcd-direct-tiled-held,wcd-direct-tiled-1m,wcd-direct-tiled-24,fastsafetensors
    grep -h "filled from\|CUDA writer:" "$OUT"/round14-1k*daemon*.log | cut -c1-220
    rm -rf /tmp/wcd-bench-load/1.6gb-*
    cold_load round14-16gb 220 16:1000 2 wcd,wcd-held,wcd-direct-tiled-held,fastsafetensors ;;
  round13)
    gpu_tests
    cold_load round13-1k 330 1.6:1000 6 wcd,wcd-direct-tiled,wcd-direct-512k,fastsafetensors
    grep -h "filled from\|CUDA writer:" "$OUT"/round13-*daemon*.log | cut -c1-220 ;;
  round12c)
    cold_load round12c-16gb 280 16:1000 3 wcd,fastsafetensors ;;
  probe12)
    timeout 200 python3 bench/disk_idle.py --ckpt 1.6:1000 --idle 0 --rounds 6 \
      --patterns buffered:16:16M,direct:4:16M:streams:4k,direct:4:16M:streams:huge,direct:16:16M:4k,direct:16:16M:huge,direct:16:512K:huge,buffered:4:16M:streams \
      --out "$OUT/probe12-patterns.json" | cut -c1-330
    python3 - "$OUT/probe12-patterns.json" <<'PY'
import json, statistics, sys
rows = json.load(open(sys.argv[1]))["trials"]
for p in dict.fromkeys(r["pattern"] for r in rows):
    rs = [r for r in rows if r["pattern"] == p]
    g = sorted(r["GBps"] for r in rs)
    print(f"{p:34} median {statistics.median(g):.3f} GB/s  range {g[0]:.2f}-{g[-1]:.2f}  "
          f"KiB/req {statistics.median(r['disk'].get('KiB_per_read', 0) for r in rs):.0f}  "
          f"queue {statistics.median(r['disk'].get('mean_queue', 0) for r in rs):.1f}")
PY
    cold_load probe12-load 200 1.6:1000 5 wcd,fastsafetensors ;;
  round12)
    gpu_tests
    BENCH_SWEEP_BYTES=524288 cold_load round12-512k 250 1.6:1000 6 wcd,wcd-direct-sweep,fastsafetensors
    cold_load round12-large 220 1.6:16 5 wcd,wcd-chunk16,fastsafetensors
    grep -h "filled from" "$OUT"/round12-*daemon*.log | cut -c1-200 ;;
  round11)
    gpu_tests
    BENCH_DAEMON_CONFIG="staging_linger_s = 0" BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 150 python3 bench/bench_load.py \
      --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --cold --cold-reps 5 --reps 1 \
      --loaders wcd,fastsafetensors --out "$OUT/round11-linger0.json" \
      --daemon-log "$OUT/round11-daemon-linger0.log" 2>&1 | grep '"round"' | cut -c1-200
    BENCH_SWEEP_BYTES=524288 BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 240 python3 bench/bench_load.py \
      --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --cold --cold-reps 6 --reps 1 \
      --loaders wcd,wcd-direct-sweep,fastsafetensors --out "$OUT/round11-linger.json" \
      --daemon-log "$OUT/round11-daemon-linger.log" 2>&1 | grep '"round"' | cut -c1-200
    for f in "$OUT"/round11-*.json; do python3 bench/summarize_load.py "$f" | cut -c1-300; done
    grep -h "filled from" "$OUT"/round11-daemon*.log | cut -c1-200 ;;
  sweep9)
    gpu_tests
    timeout 120 python3 bench/disk_idle.py --ckpt 1.6:1000 --idle 0 --rounds 4 \
      --patterns buffered:16:16M,buffered:16:4M,direct:16:512K,direct:16:4M --out "$OUT/sweep9-patterns.json" | cut -c1-300
    BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 300 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --cold --cold-reps 4 --reps 1 --loaders wcd,wcd-sweep,wcd-direct-sweep,fastsafetensors \
      --out "$OUT/sweep9-loads.json" --daemon-log "$OUT/sweep9-daemon.log" 2>&1 | grep '"round"' | cut -c1-300 ;;
  cold9)
    cold_settled 6 280 cold9- ;;
  table9)
    gpu_tests
    BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 420 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --ckpt 1.6:100000 --cold --reps 3 --loaders wcd,safetensors,fastsafetensors,instanttensor,runai \
      --out "$OUT/load-table.json" --daemon-log "$OUT/daemon-table.log" 2>&1 | tee "$OUT/load-table.log" \
      | grep -v '"wcd_verify"' | grep -v '^{"gb' | cut -c1-300
    python3 bench/summarize_load.py "$OUT/load-table.json" | cut -c1-300
    grep -E "admitting|filled from|answered" "$OUT"/daemon-table.log | cut -c1-220 ;;
  idle9)
    timeout 100 python3 bench/disk_idle.py --ckpt 1.6:1000 --idle 8,0,0,3,8,0 --out "$OUT/disk-idle-direct.json" | cut -c1-330
    timeout 60 python3 bench/disk_idle.py --ckpt 1.6:1000 --idle 8,0,8,0 --buffered --out "$OUT/disk-idle-buffered.json" | cut -c1-330
    cold_settled 4 200 ""
    BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 100 python3 bench/bench_load.py --device cpu --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --cold --cold-reps 2 --reps 1 --loaders wcd,safetensors --out "$OUT/load-host-cold.json" \
      --daemon-log "$OUT/daemon-host-cold.log" 2>&1 | grep '"round"\|plain_memfd' | cut -c1-330 ;;
  tests)
    timeout 300 python3 -m pytest tests/gpu -v -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" | cut -c1-300
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      timeout 280 python3 bench/multi_gpu.py --dir /tmp/wcd-multi --size-gb "${2:-4}" --out "$OUT/multi_gpu.json" \
        2>&1 | tee "$OUT/multi_gpu.log" | tail -60
    fi ;;
  attach)
    for mod in "cuda.bindings.driver" "wcd.arenas.cudrv"; do  # what mapping code costs to load, torch and CUDA up
      python3 -c "import time, torch; torch.zeros(1, device='cuda'); t = time.perf_counter(); import $mod as m
getattr(m, 'driver', lambda: None)() and m.driver().gpus(); print('$mod', round((time.perf_counter() - t) * 1e3, 2), 'ms')"
    done 2>&1 | tee "$OUT/mapping-import.txt"
    timeout 330 python3 bench/bench_attach.py --device cuda:0 --dir /tmp --out "$OUT/attach-h200.json" 2>&1 \
      | tee "$OUT/attach-h200.log" | tail -12
    timeout 170 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" | cut -c1-300
    timeout 60 python3 bench/bind_gpu.py --dir /tmp/wcd-bind 2>&1 | tee "$OUT/bind-gpu.log" | tail -8 ;;
  final)  # GPU tests, fixed costs, restart, then the 16 GB side-by-side load run (warm twice, cold)
    timeout 200 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|gpu-info\] (staging|primary)" | cut -c1-400
    timeout 60 python3 bench/probe_load.py --steps fixed,hashes,d2h --out "$OUT/probe-fixed.json" 2>&1 | cut -c1-700
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_load import write_checkpoint
write_checkpoint(Path('/tmp/wcd-bench-load/16gb-1000'), int(16e9), 1000, 4)
write_checkpoint(Path('/tmp/wcd-bench-load/1.6gb-100000'), int(1.6e9), 100000, 4)"
    timeout 150 python3 bench/bench_restart.py --device cuda:0 --ckpt /tmp/wcd-bench-load/16gb-1000 \
      --ckpt /tmp/wcd-bench-load/1.6gb-100000 2>&1 | tee "$OUT/restart.log" | tail -5
    timeout 330 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 16:1000 --cold --reps 2 \
      --loaders "$LOADERS" --out "$OUT/load-16gb.json" --daemon-log "$OUT/daemon-16gb.log" 2>&1 \
      | tee "$OUT/load-16gb.log" | grep -v '"wcd_verify"' | cut -c1-400 | tail -14
    grep -E "admitting|loaded" "$OUT"/daemon-16gb*.log | cut -c1-300
    timeout 90 python3 bench/probe_load.py --steps verify --out "$OUT/probe-verify.json" 2>&1 | cut -c1-900 | tail -12 ;;
  round3)  # GPU tests; 1.6 GB (1k, 100k) all loaders warm and cold; 16 GB warm (wcd) and cold (3); restart
    timeout 150 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
    # SIGINT on timeout: the benchmark's finally stops its daemons and keeps their logs.
    timeout -s INT -k 15 "${SMALL_S:-300}" python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --ckpt 1.6:100000 --cold --reps 2 --loaders "${SMALL_LOADERS:-$LOADERS}" \
      --out "$OUT/load-small.json" --daemon-log "$OUT/daemon-small.log" > "$OUT/load-small.log" 2>&1
    python3 bench/summarize_load.py "$OUT/load-small.json" || tail -5 "$OUT/load-small.log"
    grep -E "admitting|loaded" "$OUT"/daemon-small*.log | cut -c1-200
    if [ -z "${SKIP_16:-}" ]; then
      timeout -s INT -k 15 60 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 16:1000 \
        --reps 3 --loaders wcd --out "$OUT/load-16gb-warm.json" --daemon-log "$OUT/daemon-16gb-warm.log" \
        > "$OUT/load-16gb-warm.log" 2>&1
      python3 bench/summarize_load.py "$OUT/load-16gb-warm.json"
      grep -E "admitting|loaded" "$OUT/daemon-16gb-warm.log" | cut -c1-200
      timeout -s INT -k 15 150 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 16:1000 \
        --cold --reps 1 --loaders wcd,wcd-direct,fastsafetensors --out "$OUT/load-16gb-cold.json" \
        --daemon-log "$OUT/daemon-16gb-cold.log" > "$OUT/load-16gb-cold.log" 2>&1
      python3 bench/summarize_load.py "$OUT/load-16gb-cold.json"
      grep -E "loaded" "$OUT"/daemon-16gb-cold*.log | cut -c1-200
    fi
    timeout -s INT -k 15 100 python3 bench/bench_restart.py --device cuda:0 --ckpt /tmp/wcd-bench-load/1.6gb-1000 \
      --ckpt /tmp/wcd-bench-load/1.6gb-100000 2>&1 | tail -1 | cut -c1-900 ;;
  regress)  # warm loads of the code at REV (in oldtree/, made here by `git archive REV wcd bench tests |
    # tar -x -C oldtree`, carried with carry ["oldtree"]) against this tree's, alternately, one machine
    i=0
    for t in old new old new; do
      i=$((i + 1)); R=$PWD; [ $t = old ] && R=$PWD/oldtree
      (cd "$R" && PYTHONPATH=/tmp/site:$R timeout -s INT 90 python3 bench/bench_load.py --device cuda:0 --dir /tmp/bl \
        --ckpt "${2:-8}:1000" --reps 3 --loaders wcd --out "$OUT/$t-$i.json" --daemon-log "$OUT/$t-$i.log" \
        > "$OUT/$t-$i.out" 2>&1)
      echo "== $t $i"; grep -E "loaded" "$OUT/$t-$i.log" | cut -c1-110
    done ;;
  explore)  # the host's layout (NUMA, disk queue), the probe's warm, mapped and cold steps, wcd beside fastsafetensors
    { lscpu | grep -E "Model name|Socket|NUMA"; nvidia-smi topo -m; findmnt -T /tmp; lsblk -o NAME,ROTA,SIZE,MODEL,TYPE
      for q in read_ahead_kb max_sectors_kb nr_requests scheduler; do echo "$q: $(cat /sys/block/*/queue/$q | tr '\n' ' ')"; done
      for d in /sys/bus/pci/devices/*; do [ "$(cat $d/vendor)" = 0x10de ] && echo "gpu $d numa $(cat $d/numa_node)"; done
    } > "$OUT/sysinfo.txt" 2>&1; cat "$OUT/sysinfo.txt"
    timeout -s INT 300 python3 bench/probe_load.py --steps warm,mapped,cold --out "$OUT/probe-explore.json" 2>&1 \
      | tee "$OUT/probe-explore.log" | cut -c1-600
    timeout -s INT 150 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 16:1000 --cold \
      --reps 1 --loaders wcd,fastsafetensors --out "$OUT/load-explore.json" --daemon-log "$OUT/daemon-explore.log" 2>&1 \
      | grep -v '"wcd_verify"' | cut -c1-400 | tail -6
    grep -E "admitting|loaded" "$OUT"/daemon-explore*.log | cut -c1-200 ;;
  diag)  # the warm fill taken apart (probe warm and parts), the op's own parts (debug log), 1.6 GB cold beside fastsafetensors
    timeout -s INT 200 python3 bench/probe_load.py --steps warm,parts --out "$OUT/probe-diag.json" 2>&1 \
      | tee "$OUT/probe-diag.log" | grep -v "^warm \|^parts " | cut -c1-700
    BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 120 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 16:1000 --reps 4 --loaders wcd --out "$OUT/load-diag.json" --daemon-log "$OUT/daemon-diag.log" 2>&1 | tail -2
    timeout -s INT 150 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --cold \
      --reps 2 --loaders wcd,fastsafetensors --out "$OUT/load-diag-small.json" 2>&1 | grep -v '"wcd_verify"' | cut -c1-300 | tail -5
    grep -E "filled from|loaded" "$OUT"/daemon-diag*.log | cut -c1-250 ;;
  sweep)  # staging buffer sizes on the bare loop (interleaved rounds), cold reads with WILLNEED, 1.6 GB cold op's parts
    timeout -s INT 200 python3 bench/probe_load.py --steps staging,coldahead --out "$OUT/probe-sweep.json" 2>&1 \
      | tee "$OUT/probe-sweep.log" | grep -v "^staging \|^coldahead " | cut -c1-300
    BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 150 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --cold --reps 2 --loaders wcd,fastsafetensors --out "$OUT/load-sweep-small.json" \
      --daemon-log "$OUT/daemon-sweep.log" 2>&1 | grep -v '"wcd_verify"' | cut -c1-300 | tail -3
    grep -E "filled from|loaded|admitting" "$OUT"/daemon-sweep*.log | cut -c1-250 ;;
  round4)  # GPU tests, then the 1.6 GB side-by-side runs (1,000 and 100,000 tensors; five loaders, warm twice, cold)
    timeout 200 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
    timeout -s INT 420 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 \
      --ckpt 1.6:100000 --cold --reps 2 --loaders wcd,safetensors,fastsafetensors,instanttensor,runai \
      --out "$OUT/load-small.json" --daemon-log "$OUT/daemon-small.log" 2>&1 | tee "$OUT/load-small.log" \
      | grep -v '"wcd_verify"' | cut -c1-300 | tail -24
    grep -E "admitting|loaded" "$OUT"/daemon-small*.log | cut -c1-200 ;;
  round5)  # GPU tests; restart old/new alternately (cuda:0 and cpu), then with 16 GB + 64 GB kept; cold in both orders
    timeout 150 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
    restart_ab | tee "$OUT/restart-ab.txt"
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_load import write_checkpoint
write_checkpoint(Path('/tmp/wcd-bench-load/16gb-1000'), int(16e9), 1000, 4)"
    timeout 150 python3 bench/bench_restart.py --device cuda:0 --ckpt /tmp/wcd-bench-load/16gb-1000 --reserve 64 \
      --restarts 5 > "$OUT/restart-80gb.json" 2>>"$OUT/restart-err.log"; cut -c1-900 "$OUT/restart-80gb.json"
    tail -5 "$OUT/restart-err.log"
    for o in fastsafetensors,wcd wcd,fastsafetensors fastsafetensors,wcd wcd,fastsafetensors; do
      timeout -s INT 60 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --cold \
        --reps 1 --loaders $o --out "$OUT/order-$o.json" 2>&1 | grep '"cold"' | grep -v direct_read | cut -c1-200
    done | tee "$OUT/order.txt"
    timeout 120 python3 bench/bench_admit.py --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --ckpt 1.6:100000 --reps 5 \
      2>&1 | tee "$OUT/admit.txt" | tail -3
    python3 -c "import subprocess, time; from wcd.arenas import cudrv
q = lambda: subprocess.run(['nvidia-smi', '--query-gpu=memory.used', '--format=csv,noheader,nounits', '-i', '0'], capture_output=True, text=True).stdout.strip()
d = cudrv.driver(); g = d.gpus()[0]; before = q(); t = time.perf_counter(); d.retain_primary_context(g)
print('primary context: retain', round((time.perf_counter() - t) * 1e3, 1), 'ms; GPU memory used (MiB) before', before, 'holding', q())" \
      2>&1 | tee "$OUT/context.txt" ;;
  round5c)  # GPU tests; 1.6 GB, 1k and 100k tensors, five loaders, warm twice and cold; bench_admit at 100k
    timeout 150 python3 -m pytest tests/gpu -v -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
    BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 420 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --ckpt 1.6:100000 --cold --reps 2 --loaders wcd,safetensors,fastsafetensors,instanttensor,runai \
      --out "$OUT/load-small.json" --daemon-log "$OUT/daemon-small.log" 2>&1 | tee "$OUT/load-small.log" \
      | grep -v '"wcd_verify"' | cut -c1-300 | tail -24
    grep -E "admitting|filled from|loaded" "$OUT"/daemon-small*.log | cut -c1-220
    timeout 100 python3 bench/bench_admit.py --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --ckpt 1.6:100000 --reps 5 \
      2>&1 | tee "$OUT/admit.txt" | tail -3 ;;
  round6b)  # GPU tests; 64 shards of 1,560 tensors: bench_admit, warm loads with and without helpers; restart A/B
    timeout 150 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
    mkdir -p "$OUT/logs"
    timeout 120 python3 bench/bench_admit.py --dir /tmp/wcd-bench-load-64 --ckpt 1.6:100000 --shards 64 --reps 7 \
      --helpers 4 2>&1 | tee "$OUT/admit-64.txt" | tail -2
    for round in 1 2 3; do for h in default 0; do
      cfg=""; [ $h = 0 ] && cfg="header_helpers = 0"
      BENCH_DAEMON_CONFIG="$cfg" timeout 150 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load-64 \
        --shards 64 --ckpt 1.6:1000 --ckpt 1.6:100000 --reps 3 --loaders wcd \
        --out "$OUT/logs/load64-$h-$round.json" --daemon-log "$OUT/logs/daemon64-$h-$round.log" 2>&1 \
        | grep -v '"wcd_verify"' | sed "s/^/$h $round /" | cut -c1-260
    done; done
    grep -hE "admitting b1" "$OUT"/logs/daemon64-*.log | cut -c1-160
    restart_ab | tee "$OUT/restart-ab.txt"
    tar -C "$OUT" -czf "$OUT/round6b-logs.tgz" logs && rm -r "$OUT/logs" ;;
  verify)  # GPU tests; verify and digest passes at 1,000 and 100,000 tensors with 16, 8, 4 and 2 threads
    timeout 150 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
    timeout 200 python3 bench/verify_threads.py --device cuda:0 --threads 16,8,4,2 --reps 2 2>&1 \
      | tee "$OUT/verify-threads.txt" | tail -9 ;;
  round8d)  # GPU tests; trace_admit with 8 and 12 helpers; 1.6 GB 1k/100k warm loads of oldtree/ (59c79ee) and
    # this tree, alternated, three rounds
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_load import write_checkpoint
write_checkpoint(Path('/tmp/wcd-bench-load/1.6gb-100000'), int(1.6e9), 100000, 4)"
    for h in 8 12; do
      timeout 60 python3 bench/trace_admit.py --helpers $h --ckpt /tmp/wcd-bench-load/1.6gb-100000 --reps 7 \
        --pieces-per-helper 2 --out "$OUT/trace-admit-$h.json" 2>&1 | grep -E "medians|pieces per" | sed "s/^/$h helpers: /"
    done
    round7_ab "old=oldtree new=."
    grep -hE "answered|admitting b1" "$OUT"/logs/daemon-new-*.log | cut -c1-200
    tar -C "$OUT" -czf "$OUT/round8d-logs.tgz" logs && rm -r "$OUT/logs" ;;
  cold8)  # 1.6 GB / 1k cold: wcd and three peers, three rounds, the loaders' order rotated each round
    BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 540 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --cold --cold-reps 3 --reps 1 --loaders wcd,safetensors,fastsafetensors,runai \
      --out "$OUT/load-cold.json" --daemon-log "$OUT/daemon-cold.log" 2>&1 | tee "$OUT/load-cold.log" \
      | grep -E '"round"|"mode": "cold", "(wcd|safetensors|fastsafetensors|runai)"' | cut -c1-300
    grep -E "filled from" "$OUT"/daemon-cold.log | cut -c1-220 ;;
  table8)  # the 1.6 GB table: 1k and 100k tensors, five loaders, warm (best of 3) and cold
    BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 540 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --ckpt 1.6:100000 --cold --reps 3 --loaders wcd,safetensors,fastsafetensors,instanttensor,runai \
      --out "$OUT/load-table.json" --daemon-log "$OUT/daemon-table.log" 2>&1 | tee "$OUT/load-table.log" \
      | grep -v '"wcd_verify"' | cut -c1-300 | tail -24
    grep -E "admitting|filled from|loaded|answered" "$OUT"/daemon-table.log | cut -c1-220 ;;
  round8c)  # GPU tests; PIECES_PER_HELPER swept in trace_admit (8 helpers); 1.6 GB 1k/100k warm loads of
    # oldtree/ (59c79ee) and this tree, alternated; then round8b (cold with the context up or not)
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_load import write_checkpoint
write_checkpoint(Path('/tmp/wcd-bench-load/1.6gb-100000'), int(1.6e9), 100000, 4)"
    timeout 120 python3 bench/trace_admit.py --helpers 8 --ckpt /tmp/wcd-bench-load/1.6gb-100000 --reps 7 \
      --pieces-per-helper 1,2,3,4,6 --out "$OUT/trace-admit-sweep.json" 2>&1 | grep -E "medians|pieces per"
    round7_ab "old=oldtree new=."
    grep -hE "answered" "$OUT"/logs/daemon-new-*.log | cut -c1-200
    tar -C "$OUT" -czf "$OUT/round8c-logs.tgz" logs && rm -r "$OUT/logs"
    bash "$0" round8b 3 ;;
  round8b)  # cold 1.6 GB / 1k: fastsafetensors, wcd with its context up (lingering), wcd with staging_linger_s = 0
    mkdir -p "$OUT/logs"
    BENCH_DAEMON_LOG_LEVEL=debug timeout 400 python3 bench/cold_context.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --rounds "${2:-3}" --out "$OUT/cold-context.json" 2>&1 | tail -12 | cut -c1-600
    python3 -c "import json; d=json.load(open('$OUT/cold-context.json'))
for k, v in d['daemon_logs'].items():
    print(k); print(''.join(l + chr(10) for l in v.splitlines() if 'filled' in l or 'answered' in l)[-2000:])" ;;
  round8)  # GPU tests; the admission with 8 helpers in time (trace_admit); 1.6 GB 1k/100k warm loads of oldtree/
    # (59c79ee) and this tree (names checked in the helpers, each header's work as it lands), alternated
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_load import write_checkpoint
write_checkpoint(Path('/tmp/wcd-bench-load/1.6gb-100000'), int(1.6e9), 100000, 4)"
    for h in 8 0; do
      timeout 60 python3 bench/trace_admit.py --helpers $h --ckpt /tmp/wcd-bench-load/1.6gb-100000 --reps 5 \
        --out "$OUT/trace-admit-$h.json" 2>&1 | grep -E "medians|piece|^  " | head -30
    done
    round7_ab "old=oldtree new=."
    grep -hE "answered" "$OUT"/logs/daemon-new-*.log | cut -c1-200
    tar -C "$OUT" -czf "$OUT/round8-logs.tgz" logs && rm -r "$OUT/logs" ;;
  round7c)  # GPU tests; bench_admit with 8 helpers; 1.6 GB 1k/100k warm loads of oldtree/ (ddca013), oldtree2/
    # (557f1c6, round7b's) and this tree, alternated, three rounds
    round7_ab "old=oldtree r7b=oldtree2 new=."
    tar -C "$OUT" -czf "$OUT/round7c-logs.tgz" logs && rm -r "$OUT/logs" ;;
  round7b)  # GPU tests; bench_admit with 8 helpers; 1.6 GB 1k/100k warm loads of oldtree/ and this tree,
    # alternated, three rounds; the 16 GB warm load; restart of this tree with a 1.6 GB 100k entry kept
    round7_ab "old=oldtree new=."
    BENCH_DAEMON_LOG_LEVEL=debug timeout 200 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 16:1000 --reps 3 --loaders wcd --out "$OUT/logs/load-16gb.json" --daemon-log "$OUT/logs/daemon-16gb.log" \
      2>&1 | grep -v '"wcd_verify"' | cut -c1-300
    grep -hE "filled from|loaded" "$OUT/logs/daemon-16gb.log" | cut -c1-200
    for dev in cuda:0 cpu; do
      timeout 60 python3 bench/bench_restart.py --device $dev --ckpt /tmp/wcd-bench-load/1.6gb-100000 --restarts 7 \
        > "$OUT/logs/restart-${dev%%:*}.json" 2>"$OUT/logs/restart-err.log"
      echo "restart $dev $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([round(x,3) for x in d['exec_to_ready_s']], d['daemon_says'][-1][:150])" "$OUT/logs/restart-${dev%%:*}.json" 2>&1)"
    done
    tar -C "$OUT" -czf "$OUT/round7b-logs.tgz" logs && rm -r "$OUT/logs" ;;
  round7)  # GPU tests; bench_admit with 8 helpers; 1.6 GB 1k/100k warm loads of oldtree/ (4 helpers, whole shards)
    # and this tree (8 helpers by default, and 4: pieces of shards; the fingerprint beside the parse),
    # alternated, three rounds; restart A/B
    round7_ab "old=oldtree new=. new4=.:header_helpers=4"
    restart_ab | tee "$OUT/restart-ab.txt"
    tar -C "$OUT" -czf "$OUT/round7-logs.tgz" logs && rm -r "$OUT/logs" ;;
  round6)  # GPU tests; the helpers A/B three times; restart of this tree (GPU and host)
    timeout 150 python3 -m pytest tests/gpu -v -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
    bash "$0" helpers 3
    for dev in cuda:0 cpu; do
      timeout 60 python3 bench/bench_restart.py --device $dev --ckpt /tmp/wcd-bench-load/1.6gb-100000 --restarts 5 \
        > "$OUT/restart-${dev%%:*}.json" 2>"$OUT/restart-err.log"
      echo "restart $dev $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([round(x,3) for x in d['exec_to_ready_s']], d['daemon_says'][-1][:150])" "$OUT/restart-${dev%%:*}.json" 2>&1)"
    done ;;
  helpers)  # bench_admit with 4 header helpers; 1.6 GB 1k/100k warm loads, helpers (default) and none, alternated
    timeout 120 python3 bench/bench_admit.py --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --ckpt 1.6:100000 --reps 7 \
      --helpers 4 2>&1 | tee "$OUT/admit.txt" | tail -3
    mkdir -p "$OUT/logs"
    for round in $(seq 1 "${2:-2}"); do for h in default 0; do
      cfg=""; [ $h = 0 ] && cfg="header_helpers = 0"
      BENCH_DAEMON_CONFIG="$cfg" BENCH_DAEMON_LOG_LEVEL=debug timeout 150 python3 bench/bench_load.py --device cuda:0 \
        --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --ckpt 1.6:100000 --reps 3 --loaders wcd \
        --out "$OUT/logs/load-helpers-$h-$round.json" --daemon-log "$OUT/logs/daemon-helpers-$h-$round.log" 2>&1 \
        | grep -v '"wcd_verify"' | sed "s/^/$h $round /" | cut -c1-260
    done; done
    grep -hE "headers parsed|admitting|loaded" "$OUT"/logs/daemon-helpers-*.log | cut -c1-200
    tar -C "$OUT" -czf "$OUT/helpers-logs.tgz" logs && rm -r "$OUT/logs" ;;
  front)  # cold read patterns on 1.6 GB (fastsafetensors' O_DIRECT front), then fastsafetensors and wcd cold
    timeout -s INT 150 python3 bench/probe_load.py --steps front --out "$OUT/probe-front.json" 2>&1 | tail -2 | cut -c1-2500
    for L in fastsafetensors wcd wcd-direct; do
      timeout -s INT 60 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --cold \
        --reps 1 --loaders $L --out "$OUT/c-$L.json" 2>&1 | grep '"cold"' | grep -v direct_read | cut -c1-150
    done ;;
  round5b)  # GPU tests; restart old/new (both compiled); cold with 4/8/16 load workers; 1k/100k warm; 16 GB warm
    python3 -m compileall -q oldtree/wcd >/dev/null
    timeout 150 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
    restart_ab | sed 's/cuda:0/gpu/' | tee "$OUT/restart-ab.txt"
    for round in 1 2; do for w in 4 8 16 fst d4; do
      case $w in fst) L=fastsafetensors; n=16 ;; d4) L=wcd-direct; n=4 ;; *) L=wcd; n=$w ;; esac
      BENCH_DAEMON_CONFIG="load_workers = $n" timeout -s INT 60 python3 bench/bench_load.py --device cuda:0 \
        --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --cold --reps 1 --loaders $L --out "$OUT/cw.json" 2>&1 \
        | grep '"cold"' | grep -v direct_read | sed "s/^/workers $w: /" | cut -c1-160
    done; done | tee "$OUT/cold-workers.txt"
    BENCH_DAEMON_LOG_LEVEL=debug timeout -s INT 150 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load \
      --ckpt 1.6:1000 --ckpt 1.6:100000 --ckpt 16:1000 --reps 3 --loaders wcd --out "$OUT/load-warm.json" \
      --daemon-log "$OUT/daemon-warm.log" 2>&1 | grep -v '"wcd_verify"' | cut -c1-300 | tail -6
    grep -E "admitting|filled from|loaded" "$OUT"/daemon-warm*.log | cut -c1-250 ;;
  streams)  # cold reads as per-file sequential streams (fastsafetensors' pattern) against the loader's 16 x 16 MiB
    timeout -s INT 240 python3 bench/probe_load.py --steps streams --out "$OUT/probe-streams.json" 2>&1 | tail -3 | cut -c1-900 ;;
  order)  # GPU tests; then 1.6 GB cold, fastsafetensors and wcd in both orders (does the order favour the second?)
    timeout 100 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "FAILED|ERROR|passed|failed" | cut -c1-300
    for o in fastsafetensors,wcd wcd,fastsafetensors; do
      timeout -s INT 45 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --cold \
        --reps 1 --loaders $o --out "$OUT/order-$o.json" 2>&1 | grep '"cold"' | grep -v direct_read | cut -c1-200
    done ;;
  small)  # the 1.6 GB side-by-side load runs: 1,000 and 100,000 tensors, warm twice and cold
    timeout 500 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 \
      --ckpt 1.6:100000 --cold --reps 2 --loaders "$LOADERS" --out "$OUT/load-small.json" \
      --daemon-log "$OUT/daemon-small.log" 2>&1 \
      | tee "$OUT/load-small.log" | grep -v '"wcd_verify"' | cut -c1-400 | tail -24
    grep -E "admitting|loaded" "$OUT"/daemon-small*.log | cut -c1-300
    timeout 100 python3 bench/bench_restart.py --device cuda:0 --ckpt /tmp/wcd-bench-load/1.6gb-1000 \
      --ckpt /tmp/wcd-bench-load/1.6gb-100000 2>&1 | tee "$OUT/restart.log" | tail -5 ;;
  probe)
    timeout 330 python3 bench/probe_load.py --dir /tmp/wcd-bench-load --out "$OUT/probe.json" 2>&1 | tee "$OUT/probe.log"
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_load import write_checkpoint
write_checkpoint(Path('/tmp/wcd-bench-load/1.6gb-100000'), int(1.6e9), 100000, 4)"
    timeout 120 python3 bench/bench_restart.py --device cuda:0 --ckpt /tmp/wcd-bench-load/16gb-1000 \
      --ckpt /tmp/wcd-bench-load/1.6gb-100000 2>&1 | tee "$OUT/restart.log" | tail -3
    timeout 120 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 1.6:1000 --reps 1 \
      --loaders fastsafetensors,instanttensor,runai 2>&1 | tee "$OUT/peers.log" | tail -4 ;;
  check)  # GPU tests, the probe's fixed costs, a quick wcd-only load run, restart
    timeout 200 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|gpu-info\] staging" | cut -c1-400
    timeout 60 python3 bench/probe_load.py --steps fixed --out "$OUT/probe-fixed.json" 2>&1 | tail -2
    timeout 150 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 16:1000 --cold --reps 2 \
      --loaders wcd --out "$OUT/load-check.json" 2>&1 | tee "$OUT/load-check.log" | tail -3
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_load import write_checkpoint
write_checkpoint(Path('/tmp/wcd-bench-load/1.6gb-100000'), int(1.6e9), 100000, 4)"
    timeout 150 python3 bench/bench_restart.py --device cuda:0 --ckpt /tmp/wcd-bench-load/16gb-1000 \
      --ckpt /tmp/wcd-bench-load/1.6gb-100000 2>&1 | tee "$OUT/restart.log" | tail -45 ;;
  cold)  # cold read policies through the writer, then wcd against two peers, warm and cold
    timeout 200 python3 bench/probe_load.py --steps coldfill --dir /tmp/wcd-bench-load --out "$OUT/probe-cold.json" \
      2>&1 | grep -v "^{" | cut -c1-1500
    timeout 300 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 16:1000 --cold --reps 1 \
      --loaders wcd,fastsafetensors,runai --out "$OUT/load-cold.json" --daemon-log "$OUT/daemon.log" 2>&1 \
      | tee "$OUT/load-cold.log" | grep -v verify | tail -8
    grep -E "admitting|loaded" "$OUT/daemon.log" | cut -c1-300 ;;
  last)  # GPU tests, restart, then wcd against the best cold peer at 16 GB
    timeout 120 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -E "FAILED|ERROR|passed|failed|gpu-info\] (staging|primary)" | cut -c1-400
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_load import write_checkpoint
write_checkpoint(Path('/tmp/wcd-bench-load/1.6gb-1000'), int(1.6e9), 1000, 4)
write_checkpoint(Path('/tmp/wcd-bench-load/1.6gb-100000'), int(1.6e9), 100000, 4)"
    timeout 80 python3 bench/bench_restart.py --device cuda:0 --ckpt /tmp/wcd-bench-load/1.6gb-1000 \
      --ckpt /tmp/wcd-bench-load/1.6gb-100000 2>&1 | tee "$OUT/restart.log" | tail -3
    timeout 150 python3 bench/bench_load.py --device cuda:0 --dir /tmp/wcd-bench-load --ckpt 16:1000 --cold --reps 1 \
      --loaders wcd,fastsafetensors --out "$OUT/load-last.json" --daemon-log "$OUT/daemon-last.log" 2>&1 \
      | tee "$OUT/load-last.log" | grep -v '"wcd_verify"' | cut -c1-300 | tail -6
    grep -E "admitting|loaded" "$OUT/daemon-last.log" | cut -c1-300 ;;
  bench)
    timeout 560 python3 bench/bench_gpu.py --dir /tmp/wcd-bench-32 --size-gb "${2:-32}" --out "$OUT/bench_gpu.json" \
      2>&1 | tee "$OUT/bench_gpu.log" | grep -v "^\[bench\]" ;;
esac
