#!/bin/bash
# What hedging (gateway/hedging.py) costs a miss with no replica hung: a five-process mesh on
# ports 22000+, and a second gateway over the same services with HOPLINE_UPSTREAM_HEDGE_ATTEMPTS=1;
# hopline bench alternates the two (--rounds 4) at c=1 and c=32. Run from the repository root:
#   HOPLINE=$PWD/.venv/bin/hopline MODELS=$PWD/models bash bench/scripts/hedging_cost_ab.sh /tmp/hedge_ab
# Results: bench/results/2026-12-06-xeon-hedging-cost.md
set -u
WORK=${1:-/tmp/hedge_ab}; mkdir -p "$WORK"; cd "$WORK"
H=${HOPLINE:-.venv/bin/hopline}
export HOPLINE_GATEWAY_ADDR=127.0.0.1:22001 HOPLINE_TOKENIZER_ADDR=127.0.0.1:22011 \
  HOPLINE_CACHE_ADDR=127.0.0.1:22012 HOPLINE_INFERENCE_ADDR=127.0.0.1:22013 \
  HOPLINE_POSTPROCESS_ADDR=127.0.0.1:22014 HOPLINE_METRICS_PORT=22002 \
  HOPLINE_CACHE_URI=$WORK/cache.db HOPLINE_CACHE_DIR=$WORK/.hopline
rm -rf cache.db .hopline
setsid $H run --model-repo ${MODELS:-models} --topology five-process > mesh.log 2>&1 &
echo $! > mesh.pid
for i in $(seq 1 120); do grep -q " up" mesh.log && break; sleep 1; done
grep " up" mesh.log | head -1
HOPLINE_GATEWAY_ADDR=127.0.0.1:22021 HOPLINE_METRICS_PORT=22022 HOPLINE_UPSTREAM_HEDGE_ATTEMPTS=1 \
  setsid $H serve gateway > nohedge.log 2>&1 &
echo $! > nohedge.pid
sleep 8
for c in 1 32; do
  $H bench --target 127.0.0.1:22001 --peer nohedge=127.0.0.1:22021 --baseline none \
    --concurrency $c --mix miss --duration 15 --warmup 3 --rounds 4 --json bench_c$c.json > bench_c$c.txt 2>&1
  tail -12 bench_c$c.txt
done
kill -TERM -- -$(cat nohedge.pid) 2>/dev/null; kill -INT -- -$(cat mesh.pid) 2>/dev/null; sleep 5
