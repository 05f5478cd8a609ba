#!/usr/bin/env bash
# Runs the `ferrymq bench` suite for both flush modes; one JSON line per run in bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
FERRYMQ=${FERRYMQ:-.venv/bin/ferrymq}
OUT=bench/results/ferrymq-$(date -u +%Y%m%dT%H%M%SZ).jsonl
RUNS=${RUNS:-1}
for run in $(seq "$RUNS"); do
  for flush in async sync; do
    $FERRYMQ bench produce --flush $flush --messages 1000000 --size 100 --batch 1000 --json >>"$OUT"
    $FERRYMQ bench consume --flush $flush --messages 1000000 --size 100 --batch 1000 --json >>"$OUT"
    $FERRYMQ bench e2e --flush $flush --rate 2000 --duration 10 --json >>"$OUT"
    $FERRYMQ bench produce --flush $flush --messages 100000 --size 10240 --batch 100 --json >>"$OUT"
    $FERRYMQ bench consume --flush $flush --messages 100000 --size 10240 --batch 100 --json >>"$OUT"
  done
done
echo "$OUT"
