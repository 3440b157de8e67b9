#!/bin/bash
# The five-process open-loop row (make bench: p99/p50 2.84 at stop 96, 3.22 at stop 97) against
# gateways over one mesh that hedge to the same server (each stage address listed twice, as
# before stop 97 hedged a one-server upstream) or only dial it twice (hedging off), at RPS
# (default 285, 70% of the mesh's saturation on the Intel Xeon VM); hopline bench alternates them.
# Two runs at stop 97: see docs/performance.md (stop 97). Run from the repository root: bash THIS [WORKDIR]
set -u
H=${HOPLINE:-$PWD/.venv/bin/hopline}
MODELS=${MODELS:-$PWD/models}
WORK=${1:-/tmp/olab}; mkdir -p "$WORK"; cd "$WORK"
export HOPLINE_GATEWAY_ADDR=127.0.0.1:22001 HOPLINE_TOKENIZER_ADDR=127.0.0.1:22011 \
  HOPLINE_CACHE_ADDR=127.0.0.1:22012 HOPLINE_INFERENCE_ADDR=127.0.0.1:22013 \
  HOPLINE_POSTPROCESS_ADDR=127.0.0.1:22014 HOPLINE_METRICS_PORT=22002 \
  HOPLINE_CACHE_URI=$WORK/cache.db HOPLINE_CACHE_DIR=$WORK/.hopline OTEL_SDK_DISABLED=true
rm -rf cache.db .hopline
setsid $H run --model-repo $MODELS --topology five-process > mesh.log 2>&1 &
echo $! > mesh.pid
for i in $(seq 1 120); do grep -q " up" mesh.log && break; sleep 1; done
grep " up" mesh.log | head -1
HOPLINE_GATEWAY_ADDR=127.0.0.1:22021 HOPLINE_METRICS_PORT=22022 \
  HOPLINE_TOKENIZER_ADDR=ipv4:127.0.0.1:22011,127.0.0.1:22011 \
  HOPLINE_INFERENCE_ADDR=ipv4:127.0.0.1:22013,127.0.0.1:22013 \
  HOPLINE_POSTPROCESS_ADDR=ipv4:127.0.0.1:22014,127.0.0.1:22014 \
  setsid $H serve gateway > hedged.log 2>&1 &
echo $! > hedged.pid
HOPLINE_GATEWAY_ADDR=127.0.0.1:22031 HOPLINE_METRICS_PORT=22032 HOPLINE_UPSTREAM_HEDGE_ATTEMPTS=1 \
  HOPLINE_TOKENIZER_ADDR=ipv4:127.0.0.1:22011,127.0.0.1:22011 \
  HOPLINE_INFERENCE_ADDR=ipv4:127.0.0.1:22013,127.0.0.1:22013 \
  HOPLINE_POSTPROCESS_ADDR=ipv4:127.0.0.1:22014,127.0.0.1:22014 \
  setsid $H serve gateway > doubled.log 2>&1 &
echo $! > doubled.pid
sleep 8
$H bench --target 127.0.0.1:22001 --peer hedged=127.0.0.1:22021 --peer doubled=127.0.0.1:22031 --baseline none \
  --rps ${RPS:-285} --mix miss --duration 15 --warmup 3 --rounds 4 --json open.json > open.txt 2>&1
tail -16 open.txt
kill -TERM -- -$(cat hedged.pid) 2>/dev/null; kill -TERM -- -$(cat doubled.pid) 2>/dev/null; kill -INT -- -$(cat mesh.pid) 2>/dev/null; sleep 5
