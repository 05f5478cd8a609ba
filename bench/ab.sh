#!/usr/bin/env bash
# A/B of the broker and client at another commit against the working tree, alternating run by
# run in the same minutes (this VM's speed drifts: compare only within one run of this script).
#   bench/ab.sh REV [PAIRS]     e.g. bench/ab.sh 9afb344 3
# REV is checked out in a temporary worktree and run with PYTHONPATH in this checkout's .venv.
# One JSON line per run in bench/results/ab-<rev>-<time>.jsonl (field "side": base|head).
set -euo pipefail
cd "$(dirname "$0")/.."
REV=$1
PAIRS=${2:-3}
PY=${PY:-.venv/bin/python}
BASE=$(mktemp -d /tmp/ferrymq-ab-XXXXXX)
git worktree add -q --detach "$BASE" "$REV"
trap 'git worktree remove --force "$BASE"' EXIT
OUT=bench/results/ab-$(git rev-parse --short "$REV")-$(date -u +%Y%m%dT%H%M%SZ).jsonl
run() {  # side src args...
  local side=$1 src=$2; shift 2
  python3 -c "b = bytearray(3 << 30)"  # warm guest memory (bench/README, "VM memory")
  PYTHONPATH=$src $PY -m ferrymq.admin.cli bench "$@" --json | sed "s/^{/{\"side\": \"$side\", /" >>"$OUT"
}
for _ in $(seq "$PAIRS"); do
  for side in base head; do
    if [ "$side" = base ]; then src=$BASE/src; else src=$PWD/src; fi
    for flush in async sync; do
      run $side "$src" produce --flush $flush --messages 1000000 --size 100 --batch 1000
      run $side "$src" produce --flush $flush --messages 100000 --size 10240 --batch 100
      run $side "$src" e2e --flush $flush --rate 2000 --duration 10
    done
    run $side "$src" consume --flush async --messages 1000000 --size 100 --batch 1000
    run $side "$src" consume --flush async --messages 100000 --size 10240 --batch 100
  done
done
$PY - "$OUT" <<'PYEOF'
import collections, json, statistics, sys
groups = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    metric = "p99_ms" if r["workload"] == "e2e" else "msg_per_s"
    groups[(r["workload"], r["flush"], r["size"], metric, r["side"])].append(r[metric])
for key in sorted(k[:4] for k in groups if k[4] == "base"):
    base, head = groups[(*key, "base")], groups[(*key, "head")]
    mb, mh = statistics.median(base), statistics.median(head)
    print(f"{key[0]:8} {key[1]:5} {key[2]:6} {key[3]:9} base {mb:12,.2f}  head {mh:12,.2f}  "
          f"head/base {mh / mb:.2f}")
PYEOF
echo "$OUT"
