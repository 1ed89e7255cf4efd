#!/usr/bin/env bash
# EPLB benchmark (not a test; it measures live rebalancing's bounds): a skewed model (`dxs gen-model
# --router-skew S`) on 1 attention + 4 expert ranks, EPLB off and on in the same run.
#   off: dxs-router --elastic-ep (no replicas, no EPLB)
#   on:  dxs-router --elastic-ep --num-redundant-experts R --enable-eplb --eplb-interval I
# For each: the balance ratio (the attention rank's dxs_ep_balance_ratio, mean over max
# tokens per EP rank per MoE layer step; and the same from the experts'
# dxs_tokens_received_total over the whole window), the slowest EP rank's expert compute
# per layer round over the mean rank's (dxs_expert_compute_seconds), and output tokens/s
# (`dxs bench`). Then how long things take:
#   rebalance: on a fresh "on" cluster under load, `dxs rebalance` (measure, load, publish:
#     the RPC returns once the placement is published), the first rebalance, from the
#     load-blind default placement; DXS_BENCH_TRIALS times, each on a new cluster;
#   the stall it causes (the EPLB bound: at most one step): the longest gap between two tokens of
#     any stream of the load across it, beside the same cluster's quiet load just before
#     (same size, no rebalance). Nothing else runs during either load: no polling;
#   recovery, covered: kill -9, under load, an EP rank all of whose experts have a replica
#     elsewhere: the longest gap between tokens across the kill (the EPLB bound: at most 1 s),
#     beside the load before it; dxs_eplb_recovery_duration_seconds; errors;
#   recovery, uncovered: the same on the "off" cluster (no replicas: its experts are
#     reloaded on the live ranks). After each load, `dxs status` must show the rank gone.
# The processes are started directly, not with `dxs up --elastic-ep`: the bench kills one
# expert by pid, and `dxs up --elastic-ep` would start it again.
# Usage: bench/eplb_bench.sh
# Environment: DXS_BENCH_SKEW (1.0), DXS_BENCH_PRESET (default), DXS_BENCH_REQUESTS (1024),
# DXS_BENCH_CONCURRENCY (32), DXS_BENCH_PROMPT_LEN (16), DXS_BENCH_OUTPUT_LEN (32),
# DXS_BENCH_REDUNDANT (R; the preset's expert count), DXS_BENCH_EPLB_INTERVAL (1000 steps),
# DXS_BENCH_ROUNDS (3: off and on alternate, tok/s is the median), DXS_BENCH_TRIALS (3:
# rebalance stall trials), DXS_ATTENTION_ARGS (extra
# dxs-attention flags, e.g. --overlap-min-tokens 0), DXS_BIN_DIR (build/bin),
# DXS_BENCH_GPUS (empty: CPU workers; else GPU ordinals as `dxs up --gpus` takes them, e.g.
# 0,1,2,3,4: the attention rank on the first, the expert ranks on the next, round the list;
# EPLB off and on, on the GPU path).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${DXS_BIN_DIR:-build/bin}
SKEW=${DXS_BENCH_SKEW:-1.0}
PRESET=${DXS_BENCH_PRESET:-default}
REQUESTS=${DXS_BENCH_REQUESTS:-1024}
CONCURRENCY=${DXS_BENCH_CONCURRENCY:-32}
PROMPT=${DXS_BENCH_PROMPT_LEN:-16}
OUTPUT=${DXS_BENCH_OUTPUT_LEN:-32}
INTERVAL=${DXS_BENCH_EPLB_INTERVAL:-1000}
ROUNDS=${DXS_BENCH_ROUNDS:-3}
TRIALS=${DXS_BENCH_TRIALS:-3}
NUM_EP=4
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
MODEL=$WORK/model
"$BIN/dxs" gen-model --preset "$PRESET" --router-skew "$SKEW" --out "$MODEL" >/dev/null
NUM_EXPERTS=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["num_experts"])' "$MODEL/config.json")
REDUNDANT=${DXS_BENCH_REDUNDANT:-$NUM_EXPERTS}
now() { date +%s.%N; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# The --device of process i (0: the attention rank, 1..: the expert ranks).
IFS=, read -r -a GPU_LIST <<<"${DXS_BENCH_GPUS:-}"
device_of() {
  if [ ${#GPU_LIST[@]} -eq 0 ]; then echo cpu; else echo "cuda:${GPU_LIST[$(($1 % ${#GPU_LIST[@]}))]}"; fi
}
status_json() { "$BIN/dxs" status --router "$ROUTER" --format json 2>/dev/null; }

# start_cluster TAG [dxs-router flags]: starts a cluster, and `use TAG` makes it the one
# the functions below talk to (ROUTER, ROUTER_METRICS, EXPERT_PID[r]). Idle clusters sleep,
# so two can be up at once and measured in alternation.
declare -A ROUTERS RMETRICS EPIDS
use() {
  ROUTER=${ROUTERS[$1]}
  ROUTER_METRICS=${RMETRICS[$1]}
  read -r -a EXPERT_PID <<<"${EPIDS[$1]}"
}
start_cluster() {
  local tag=$1
  shift
  ROUTER=127.0.0.1:$(free_port)
  "$BIN/dxs-router" --listen "$ROUTER" --model "$MODEL" --attention 1 --experts $NUM_EP "$@" \
    >"$WORK/$tag-router.log" 2>&1 &
  PIDS+=($!)
  EXPERT_PID=()
  for r in $(seq 0 $((NUM_EP - 1))); do
    "$BIN/dxs-expert" --model "$MODEL" --rank "$r" --router "$ROUTER" --device "$(device_of $((r + 1)))" \
      >"$WORK/$tag-expert$r.log" 2>&1 &
    EXPERT_PID[r]=$!
    PIDS+=($!)
  done
  # shellcheck disable=SC2086
  "$BIN/dxs-attention" --model "$MODEL" --rank 0 --router "$ROUTER" --device "$(device_of 0)" ${DXS_ATTENTION_ARGS:-} \
    >"$WORK/$tag-attention0.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 240); do
    "$BIN/dxs" generate --router "$ROUTER" --prompt-ids 1,2,3 --max-new-tokens 2 >/dev/null 2>&1 && break
    sleep 0.5
  done
  "$BIN/dxs" generate --router "$ROUTER" --prompt-ids 1,2,3 --max-new-tokens 2 >/dev/null 2>&1 ||
    { tail -n 5 "$WORK/$tag"-*.log; exit 1; }
  ROUTERS[$tag]=$ROUTER
  RMETRICS[$tag]=$(grep -o 'metrics on [^ ,]*' "$WORK/$tag-router.log" | head -n 1 | cut -d' ' -f3)
  EPIDS[$tag]="${EXPERT_PID[*]}"
}
stop_cluster() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
# scrape FILE: every worker's and the router's /metrics, as JSON {address: text}.
scrape() {
  status_json | python3 -c '
import json, sys, urllib.request
view = json.load(sys.stdin)
addrs = [w["metrics_address"] for w in view["workers"] if w["metrics_address"] and w["state"] != "DEAD"]
out = {}
for a in addrs + [sys.argv[1]]:
    try:
        out[a] = urllib.request.urlopen("http://%s/metrics" % a, timeout=5).read().decode()
    except OSError:
        pass
print(json.dumps(out))' "$ROUTER_METRICS" >"$1"
}
# metrics BEFORE AFTER: "balance_hist balance_tokens compute_max_over_mean" over the window.
metrics() {
  python3 - "$1" "$2" <<'EOF'
import json, re, sys
def series(path):
    out = {}
    for text in json.load(open(path)).values():
        for line in text.splitlines():
            m = re.match(r'^([a-z_]+)(\{[^}]*\})? ([-+0-9.eEinfNa]+)$', line)
            if m:
                out[m.group(1) + (m.group(2) or '')] = float(m.group(3))
    return out
a, b = series(sys.argv[1]), series(sys.argv[2])
d = lambda k: b.get(k, 0.0) - a.get(k, 0.0)
def by_rank(name):
    r = {}
    for k in b:
        m = re.match(name + r'\{.*rank="(\d+)".*\}$', k)
        if m and 'ep_rank' not in k:
            r[int(m.group(1))] = d(k)
    return r
s, c = sum(by_rank('dxs_ep_balance_ratio_sum').values()), sum(by_rank('dxs_ep_balance_ratio_count').values())
tok = list(by_rank('dxs_tokens_received_total').values())
cs, cc = by_rank('dxs_expert_compute_seconds_sum'), by_rank('dxs_expert_compute_seconds_count')
per = [cs[r] / cc[r] for r in cs if cc.get(r)]
print('%.3f %.3f %.2f %d %d' % (s / c if c else float('nan'),
                          (sum(tok) / len(tok)) / max(tok) if tok and max(tok) else float('nan'),
                          max(per) / (sum(per) / len(per)) if per else float('nan'),
                          sum(tok), d('dxs_eplb_rebalances_total')))
EOF
}
# hist_mean BEFORE AFTER NAME: the mean of a histogram's new observations.
hist_mean() {
  python3 - "$1" "$2" "$3" <<'EOF'
import json, re, sys
def get(path, key):
    for text in json.load(open(path)).values():
        for line in text.splitlines():
            if line.startswith(key + ' ') or line.startswith(key + '{'):
                return float(line.split()[-1])
    return 0.0
n = get(sys.argv[2], sys.argv[3] + '_count') - get(sys.argv[1], sys.argv[3] + '_count')
s = get(sys.argv[2], sys.argv[3] + '_sum') - get(sys.argv[1], sys.argv[3] + '_sum')
print('%.3f' % (s / n) if n else 'none')
EOF
}
bench() {
  "$BIN/dxs" bench --router "$ROUTER" --concurrency "$CONCURRENCY" --requests "$1" \
    --prompt-len "$PROMPT" --output-len "$OUTPUT" --format json 2>/dev/null
}
json_field() { python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }
errors() { python3 -c 'import json,sys; e=json.load(sys.stdin)["errors"]; print(sum(e.values()) if isinstance(e, dict) else e)'; }
e2e_p99() { python3 -c 'import json,sys; print("%.0f" % json.load(sys.stdin)["e2e_ms"]["p99"])'; }
placement_version() { status_json | json_field placement_version; }
# The EP rank to kill: covered=1, one all of whose experts are held elsewhere too;
# covered=0, any rank (the highest) holding experts.
victim() {
  status_json | python3 -c '
import json, sys
p = json.load(sys.stdin)["placement"]
held = {r["rank"]: set(r["experts"]) for r in p}
want = sys.argv[1] == "1"
for r in sorted(held, reverse=True):
    others = set().union(*[h for q, h in held.items() if q != r])
    if held[r] and (not want or held[r] <= others):
        print(r); break
else:
    print(-1)' "$1"
}
itl_max() { python3 -c 'import json,sys; print("%.1f" % json.load(sys.stdin)["itl_ms"]["max"])'; }
# recovery COVERED TAG: kill -9 a rank under load; prints "stall_ms quiet_ms metric_seconds
# killed-rank/errors gone": the longest gap between tokens of the load across the kill, of
# the same load just before (no kill), the recovery histogram's mean, and whether
# `dxs status` shows a placement without the rank once the load is over.
recovery() {
  local r
  r=$(victim "$1")
  if [ "$r" -lt 0 ]; then echo "n/a n/a n/a n/a n/a"; return; fi
  bench $((REQUESTS / 2)) >"$WORK/$2-rec-quiet.json"
  scrape "$WORK/$2-rec0.json"
  bench $((REQUESTS / 2)) >"$WORK/$2-rec-bench.json" &
  local load=$!
  sleep 1.5
  kill -9 "${EXPERT_PID[r]}"
  wait $load || true
  local gone
  gone=$(status_json | python3 -c '
import json, sys
p = {r["rank"]: r["experts"] for r in json.load(sys.stdin)["placement"]}
all_held = set().union(*[set(e) for q, e in p.items() if q != int(sys.argv[1])])
print("yes" if not p.get(int(sys.argv[1])) and len(all_held) == int(sys.argv[2]) else "no")' \
    "$r" "$NUM_EXPERTS" 2>/dev/null || echo no)
  scrape "$WORK/$2-rec1.json"
  echo "$(itl_max <"$WORK/$2-rec-bench.json") $(itl_max <"$WORK/$2-rec-quiet.json") \
$(hist_mean "$WORK/$2-rec0.json" "$WORK/$2-rec1.json" dxs_eplb_recovery_duration_seconds) \
rank$r/$(errors <"$WORK/$2-rec-bench.json") $gone"
}
# rebalance_trial TAG: on cluster TAG (in use), a quiet load, then the same load with
# `dxs rebalance` 1 s into it; prints "rpc_s stall_ms quiet_ms p50_ms errors rebalance-output".
rebalance_trial() {
  bench $((REQUESTS / 2)) >"$WORK/$1-quiet.json"
  bench $((REQUESTS / 2)) >"$WORK/$1-rebalance.json" &
  local load=$! t0 t1 out
  sleep 1
  t0=$(now)
  out=$("$BIN/dxs" rebalance --router "$ROUTER" 2>&1) || true
  t1=$(now)
  wait $load || true
  echo "$(python3 -c "print('%.3f' % ($t1 - $t0))") $(itl_max <"$WORK/$1-rebalance.json") \
$(itl_max <"$WORK/$1-quiet.json") \
$(python3 -c 'import json,sys; print("%.1f" % json.load(sys.stdin)["itl_ms"]["p50"])' <"$WORK/$1-rebalance.json") \
$(errors <"$WORK/$1-rebalance.json") $out"
}
# stats V...: "median min max".
stats() { python3 -c 'import sys,statistics as s; v=sorted(map(float,sys.argv[1:])); print(s.median(v), v[0], v[-1])' "$@"; }

echo "eplb_bench: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)),"\
     "1 attention + $NUM_EP expert ranks on loopback (UCX); preset $PRESET, $NUM_EXPERTS experts,"\
     "router skew $SKEW; $REQUESTS requests at concurrency $CONCURRENCY, prompt $PROMPT, output $OUTPUT"

start_cluster off --elastic-ep
start_cluster on --elastic-ep --num-redundant-experts "$REDUNDANT" --enable-eplb --eplb-interval "$INTERVAL"
# The first rebalance, by hand, under load: from the load-blind default placement.
use on
TRIAL[1]=$(rebalance_trial on)
# Off and on alternate, ROUNDS benches each, so a burst of load elsewhere hits both alike;
# the counters are read once before the first round and once after the last.
for tag in off on; do use $tag; bench $((REQUESTS / 4)) >/dev/null || true; scrape "$WORK/$tag-m0.json"; done
declare -A TPS P99 ERRS ITL_MAX
for i in $(seq "$ROUNDS"); do
  for tag in off on; do
    use $tag
    bench "$REQUESTS" >"$WORK/$tag-bench$i.json" || true
    TPS[$tag]+=" $(json_field output_tokens_per_second <"$WORK/$tag-bench$i.json")"
    P99[$tag]+=" $(e2e_p99 <"$WORK/$tag-bench$i.json")"
    ERRS[$tag]=$((${ERRS[$tag]:-0} + $(errors <"$WORK/$tag-bench$i.json")))
    ITL_MAX[$tag]+=" $(python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["itl_ms"]["max"])' <"$WORK/$tag-bench$i.json" 2>/dev/null || echo 0)"
  done
done
for tag in off on; do use $tag; scrape "$WORK/$tag-m1.json"; done
use off
REC_UNCOVERED=$(recovery 0 off)
stop_cluster

# More rebalance trials, each on a new cluster (only the first rebalance moves experts).
for i in $(seq 2 "$TRIALS"); do
  start_cluster "trial$i" --elastic-ep --num-redundant-experts "$REDUNDANT" --enable-eplb \
    --eplb-interval "$INTERVAL"
  use "trial$i"
  TRIAL[i]=$(rebalance_trial "trial$i")
  stop_cluster
done

# Replica cover: the default placement with R >= E experts holds every expert on two
# ranks (EPLB's placements replicate the hot experts, leaving cold ones single).
start_cluster cover --elastic-ep --num-redundant-experts "$REDUNDANT"
use cover
REC_COVERED=$(recovery 1 cover)
stop_cluster

echo
printf '%-5s %8s %8s %17s %24s %11s %11s %7s %12s\n' EPLB balance tok-bal "compute max/mean" \
  "tok/s median (min-max)" "rows/token" rebalances errors "e2e p99 med"
for tag in off on; do
  read -r b t c rows reb <<<"$(metrics "$WORK/$tag-m0.json" "$WORK/$tag-m1.json")"
  read -r tm tmin tmax <<<"$(stats ${TPS[$tag]})"
  read -r pm _ _ <<<"$(stats ${P99[$tag]})"
  python3 -c "print('%-5s %8s %8s %17s %8.0f (%6.0f-%6.0f) %11.1f %11s %7s %9.0f ms' % ('$tag', '$b', '$t', '$c', $tm, $tmin, $tmax, $rows / ($ROUNDS * $REQUESTS * $OUTPUT), '$reb', '${ERRS[$tag]}', $pm))"
done
echo "(balance: dxs_ep_balance_ratio, per MoE layer step; tok-bal: mean/max over EP ranks of"
echo " dxs_tokens_received_total over the window; compute: dxs_expert_compute_seconds per layer"
echo " round, slowest rank over the mean; rows/token: rows the EP ranks received per output token)"
echo "rebalance under load (R=$REDUNDANT, the first one: from the default placement), $TRIALS trials on new clusters:"
echo "  trial  RPC s  longest gap ms (across it / quiet load before)  median gap ms  errors  result"
for i in $(seq "$TRIALS"); do
  read -r rpc stall quiet p50 err out <<<"${TRIAL[i]}"
  printf '  %5d  %5s  %14s / %-28s  %13s  %6s  %s\n' "$i" "$rpc" "$stall" "$quiet" "$p50" "$err" "$out"
done
echo "  (longest gap quiet: the on cluster's measured rounds too: ${ITL_MAX[on]} ms)"
read -r stall quiet m re gone <<<"$REC_COVERED"
echo "recovery, replica cover:    longest gap across the kill $stall ms (quiet load before: $quiet ms); dxs_eplb_recovery_duration_seconds $m s; killed/errors $re; rank gone from dxs status: $gone"
read -r stall quiet m re gone <<<"$REC_UNCOVERED"
echo "recovery, no replica cover: longest gap across the kill $stall ms (quiet load before: $quiet ms); dxs_eplb_recovery_duration_seconds $m s; killed/errors $re; rank gone from dxs status: $gone"
