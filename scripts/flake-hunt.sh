#!/usr/bin/env bash
# Runs the timing-sensitive tests N times under each of three conditions and prints a table
# of runs and failures per test and condition:
#   j2       ctest -j2 (two tests at once, the machine otherwise idle)
#   busy     ctest -j2 while stress-ng keeps every core busy
#   onecore  ctest -j2, every process pinned to one core with taskset
# A test that holds on a machine several times faster or slower than the one it was written
# on passes under all three.
#
# usage: scripts/flake-hunt.sh [-n N] [-c j2,busy,onecore] [-L LABEL]... [-R REGEX] [-E REGEX]
#                              [-s SLOTS]
#   -n N       runs of each test under each condition (default 20)
#   -c LIST    conditions, comma-separated (default all three)
#   -L LABEL   ctest label to select (repeatable: any of them; default: disagg)
#   -R REGEX   ctest name filter (with or instead of labels)
#   -E REGEX   ctest names to leave out
#   -s SLOTS   on a machine of many cores: SLOTS copies at once, each pinned to two cores of
#              its own (a 2-core machine each; DXS_FLAKE_SLOT_CORES=1: one core each, which
#              suits `-c onecore`), sharing the N runs; one table at the end
#   -T         no runs: the table of the reports already in DXS_FLAKE_OUT
# Environment: DXS_BUILD_DIR (default build), DXS_FLAKE_JOBS (ctest -j, default 2),
# DXS_FLAKE_OUT (where the JUnit reports and the table go; default build/flake-hunt).
# Exit status 1 when any run failed. Installs stress-ng (Debian) for `busy` when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${DXS_BUILD_DIR:-build}
jobs=${DXS_FLAKE_JOBS:-2}
out=${DXS_FLAKE_OUT:-$build_dir/flake-hunt}
runs=20
conditions=j2,busy,onecore
labels=()
regex=""
exclude=""
slots=1
tabulate_only=0
while getopts "n:c:L:R:E:s:Th" opt; do
  case $opt in
    n) runs=$OPTARG ;;
    c) conditions=$OPTARG ;;
    L) labels+=("$OPTARG") ;;
    R) regex=$OPTARG ;;
    E) exclude=$OPTARG ;;
    s) slots=$OPTARG ;;
    T) tabulate_only=1 runs=0 ;;
    *) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
[ ${#labels[@]} -eq 0 ] && [ -z "$regex" ] && labels=(disagg)
case $runs in '' | *[!0-9]*) echo "flake-hunt: -n must be a number, got '$runs'" >&2; exit 2 ;; esac
[ -f "$build_dir/CTestTestfile.cmake" ] || {
  echo "flake-hunt: no build in $build_dir; run scripts/build.sh first" >&2
  exit 2
}

select=()
# ctest ANDs repeated -L options; labels here are alternatives: one regex.
[ ${#labels[@]} -gt 0 ] && select+=(-L "^($(IFS='|'; echo "${labels[*]}"))\$")
[ -n "$regex" ] && select+=(-R "$regex")
[ -n "$exclude" ] && select+=(-E "$exclude")

IFS=, read -r -a conds <<<"$conditions"
for c in "${conds[@]}"; do
  case $c in
    j2 | onecore) ;;
    busy)
      if ! command -v stress-ng >/dev/null; then
        echo "flake-hunt: installing stress-ng"
        SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
          stress-ng >/dev/null 2>&1 ||
          echo "flake-hunt: no stress-ng; busy loops of the shell keep the cores busy instead"
      fi
      ;;
    *) echo "flake-hunt: unknown condition '$c' (j2, busy, onecore)" >&2; exit 2 ;;
  esac
done

mkdir -p "$out"
[ "$tabulate_only" = 1 ] || rm -rf "$out"/*.xml "$out"/slot-*
out=$(realpath "$out")

# Slots: this script again, once per slot, on two cores of its own; then the table of all.
if [ "$slots" -gt 1 ] && [ "$tabulate_only" = 0 ]; then
  cores=()
  for range in $(taskset -pc $$ | sed 's/.*: //; s/,/ /g'); do
    cores+=($(seq "${range%-*}" "${range#*-}"))
  done
  per_slot=${DXS_FLAKE_SLOT_CORES:-2}
  [ "${#cores[@]}" -ge $((per_slot * slots)) ] || {
    echo "flake-hunt: $slots slots need $((per_slot * slots)) cores; this process has ${#cores[@]}" >&2
    exit 2
  }
  args=(-c "$conditions")
  for l in "${labels[@]}"; do args+=(-L "$l"); done
  [ -n "$regex" ] && args+=(-R "$regex")
  [ -n "$exclude" ] && args+=(-E "$exclude")
  pids=()
  for k in $(seq 0 $((slots - 1))); do
    n=$((runs / slots + (k < runs % slots ? 1 : 0)))
    [ "$n" -gt 0 ] || continue
    mine=$(IFS=,; echo "${cores[*]:$((per_slot * k)):$per_slot}")
    DXS_FLAKE_OUT="$out/slot-$k" taskset -c "$mine" "$0" -n "$n" "${args[@]}" \
      >"$out/slot-$k.log" 2>&1 &
    pids+=($!)
  done
  echo "flake-hunt: $slots slots running, logs in $out/slot-*.log"
  for p in "${pids[@]}"; do wait "$p" || true; done
  runs=0  # every run is done; what follows only tabulates
fi
# Keeps every core this script may run on busy (nproc counts the cores of its affinity).
busy_pids=()
start_busy() {
  if command -v stress-ng >/dev/null; then
    stress-ng --cpu "$(nproc)" --quiet >/dev/null 2>&1 &
    busy_pids+=($!)
  else
    for _ in $(seq 1 "$(nproc)"); do
      sh -c 'while :; do :; done' &
      busy_pids+=($!)
    done
  fi
}
cleanup() {
  [ ${#busy_pids[@]} -gt 0 ] && kill "${busy_pids[@]}" 2>/dev/null
  busy_pids=()
  true
}
trap cleanup EXIT

if [ "$runs" -gt 0 ]; then
  count=$(ctest --test-dir "$build_dir" -N "${select[@]}" | sed -n 's/^Total Tests: //p')
  [ "${count:-0}" -gt 0 ] || {
    echo "flake-hunt: no test matches ${select[*]}" >&2
    exit 2
  }
  echo "flake-hunt: $count tests x ${#conds[@]} conditions x $runs runs (ctest -j$jobs); reports in $out"
  for c in "${conds[@]}"; do
    prefix=()
    case $c in
      busy) start_busy ;;
      onecore) prefix=(taskset -c "$(taskset -pc $$ | sed 's/.*: //; s/[,-].*//')") ;;
    esac
    for i in $(seq 1 "$runs"); do
      start=$SECONDS
      "${prefix[@]}" ctest --test-dir "$build_dir" "${select[@]}" -j "$jobs" -Q \
        --output-junit "$out/$c-$i.xml" || true
      echo "flake-hunt: $c run $i of $runs: $((SECONDS - start)) s"
    done
    cleanup
  done
fi

python3 - "$out" "${conds[@]}" <<'PY'
import glob, os, sys
import xml.etree.ElementTree as ET
out, conds = sys.argv[1], sys.argv[2:]
table = {}  # test -> cond -> [runs, failures]
for c in conds:
    for path in sorted(glob.glob(os.path.join(out, f"{c}-*.xml")) +
                       glob.glob(os.path.join(out, "slot-*", f"{c}-*.xml"))):
        for case in ET.parse(path).getroot().iter("testcase"):
            name = case.get("name")
            # Skipped, not run, and disabled (ctest reports those as cases too) are no runs.
            if (case.find("skipped") is not None
                    or case.get("status") in ("notrun", "disabled")):
                continue
            cell = table.setdefault(name, {}).setdefault(c, [0, 0])
            cell[0] += 1
            if case.find("failure") is not None or case.find("error") is not None:
                cell[1] += 1
                sys.stderr.write(f"flake-hunt: FAILED {name} ({c}, {os.path.basename(path)})\n")
if not table:
    print("flake-hunt: no test ran (no reports in " + out + ")", file=sys.stderr)
    sys.exit(1)
width = max([len(t) for t in table] + [4])
lines = ["| " + "test".ljust(width) + " | " + " | ".join(f"{c} (runs/failed)" for c in conds) + " |",
         "|" + "-" * (width + 2) + "|" + "|".join("-" * (len(c) + 16) for c in conds) + "|"]
failed = 0
for t in sorted(table):
    cells = []
    for c in conds:
        r, f = table[t].get(c, [0, 0])
        failed += f
        cells.append(f"{r}/{f}".ljust(len(c) + 14))
    lines.append("| " + t.ljust(width) + " | " + " | ".join(cells) + " |")
text = "\n".join(lines) + "\n"
open(os.path.join(out, "table.md"), "w").write(text)
print(text, end="")
print(f"flake-hunt: {failed} failed runs" + ("" if failed else "; every run passed"))
sys.exit(1 if failed else 0)
PY
