#!/usr/bin/env bash
# Runs the `ferrymq bench` suite for both flush modes; one JSON line per run in bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
FERRYMQ=${FERRYMQ:-.venv/bin/ferrymq}
OUT=bench/results/ferrymq-$(date -u +%Y%m%dT%H%M%SZ).jsonl
RUNS=${RUNS:-1}
# PRETOUCH_GB=N: touch N GiB of memory before each workload. On a VM that hands freed guest
# memory back to the host (Firecracker's free page reporting here), the first touch of a page
# costs a host fault: writing 1 GiB into the page cache took 2.6 s of system time cold and 0.21 s
# warm, which swamps the broker's own cost in the 10 KB workloads (bench/README, session 8).
PRETOUCH_GB=${PRETOUCH_GB:-0}
pretouch() {
  if [ "$PRETOUCH_GB" -gt 0 ]; then
    python3 -c "b = bytearray($PRETOUCH_GB << 30)"
  fi
}
for run in $(seq "$RUNS"); do
  for flush in async sync; do
    pretouch
    $FERRYMQ bench produce --flush $flush --messages 1000000 --size 100 --batch 1000 --json >>"$OUT"
    $FERRYMQ bench consume --flush $flush --messages 1000000 --size 100 --batch 1000 --json >>"$OUT"
    $FERRYMQ bench e2e --flush $flush --rate 2000 --duration 10 --json >>"$OUT"
    $FERRYMQ bench e2e --flush $flush --rate 2000 --duration 10 --pacing spin --json >>"$OUT"
    pretouch
    $FERRYMQ bench produce --flush $flush --messages 100000 --size 10240 --batch 100 --json >>"$OUT"
    pretouch
    $FERRYMQ bench consume --flush $flush --messages 100000 --size 10240 --batch 100 --json >>"$OUT"
  done
done
echo "$OUT"
