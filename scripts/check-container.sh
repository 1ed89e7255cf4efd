#!/usr/bin/env bash
# Single quotes here hold text for dpkg-query and for shells inside the chroot.
# shellcheck disable=SC2016

# Builds deploy/container/Dockerfile with a real container engine and checks the images:
#   - `podman build --isolation chroot` (Debian's podman 4.3), FROM a Debian 12 root made
#     with debootstrap and brought in with `podman import` (standing in for debian:bookworm);
#   - the image's metadata: USER 10001, the entrypoint, the exposed ports (gRPC, the
#     gateway's HTTP, metrics) and the OCI labels;
#   - its file system (`podman export`): no compiler, no -dev package and nothing from the
#     build stage but binaries; every shared library the binaries need (ldd);
#   - run in a chroot (chroot-run.py; `podman run` cannot start containers where crun
#     refuses the machine's cgroups), as USER 10001 with the image's ENV and WORKDIR:
#     `dxs help` and `dxs-router --help` work, and a 2 DP x 2 EP cluster started through the
#     entrypoint (ranks taken from POD_INDEX and from the pod-style HOSTNAME, as in
#     Kubernetes) answers `dxs generate` and `dxs status`, serves /metrics on every
#     process, keeps UCX inside UCX_TCP_PORT_RANGE (what the NetworkPolicy opens), then
#     stops on SIGTERM; `dxs run --device cuda` fails with one line (no CUDA backend); the
#     SMG gateway (`smg launch`, as deploy/k8s runs it, on loopback with a worker that is
#     not there) answers /liveness, reports itself not ready on /readiness and serves
#     smg_* metrics;
#   - the CUDA image (target cuda), when DXS_PREBUILT_BIN has libdxs_cuda.so (a CUDA build),
#     built from the same layers plus cuBLAS from PyPI, checked without a GPU: metadata and
#     Debian packages as the CPU image's; the plugin, cuBLAS and UCX's CUDA runtime present,
#     no driver library (libcuda.so.1, libnvidia-ml.so.1: the node's); ldd of the binaries,
#     the plugin, cuBLAS and UCX's modules finds all but the driver's libraries; cuBLAS
#     loads by name as USER; `dxs run --device cuda` exits 1 with the plugin's one-line
#     "no usable GPU" error, and `dxs run` on the CPU works.
#
#   DXS_CHECK_CONTAINER=1 scripts/check-container.sh
# scripts/run-tests.sh runs it with DXS_PREBUILT_BIN=build/bin: about 2 minutes on a 2-core
# VM (1.5 of them apt installing the build stage's dependencies; debootstrap adds half a
# minute the first time); the CUDA image about 1 more (the 420 MB cuBLAS wheel, a 570 MB
# layer, its export), and --layers, which the CUDA image's reuse of the build stage needs,
# costs the CPU build's commits of every step (measured on a busy 2-core machine with stub
# binaries: CPU build 88 s with --layers=false, 185 s with --layers; CUDA image 68 s). Compiling inside the image as well takes far longer on such a
# machine, so that stays a manual run. Needs root, podman and debootstrap (installed when
# missing) and a Debian mirror. Environment:
#   DXS_CONTAINER_WORK   work directory [/tmp/dxs-container-check]; the debootstrapped base
#                        is kept there and reused (DXS_CONTAINER_FRESH=1 makes it again)
#   DXS_DEBIAN_MIRROR    [http://deb.debian.org/debian]
#   DXS_PREBUILT_BIN     a directory with dxs, dxs-router, dxs-attention, dxs-expert built
#                        from this tree on Debian 12, mounted into the build: the build
#                        stage then installs the dependencies and configures but does not
#                        compile (build-steps.sh), for machines too small to build twice.
#                        With libdxs_cuda.so there too, the CUDA image is built and
#                        checked; without it (or without DXS_PREBUILT_BIN) it is skipped
#   DXS_CHECK_KEEP=1     keep the images and the exported roots afterwards
#   DXS_BUILD_CA_BUNDLE  a CA bundle for pip in the build stage [$PIP_CERT or
#                        $REQUESTS_CA_BUNDLE]: for machines behind a TLS-intercepting proxy
# Runs under `flock /tmp/dxs-build.lock`, like other heavy jobs on shared machines.
set -euo pipefail

if [ "${DXS_CHECK_CONTAINER:-0}" != 1 ]; then
  echo "check-container: skipped (set DXS_CHECK_CONTAINER=1 to run it; it needs root and minutes)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "check-container: needs root (debootstrap, podman, chroot, mount)" >&2
  exit 1
fi
if [ -z "${DXS_CHECK_CONTAINER_LOCKED:-}" ]; then
  exec env DXS_CHECK_CONTAINER_LOCKED=1 flock /tmp/dxs-build.lock "$0" "$@"
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
work=${DXS_CONTAINER_WORK:-/tmp/dxs-container-check}
mirror=${DXS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
runner=$repo/deploy/container/chroot-run.py
base_image=localhost/dxs-check-base:bookworm
image=localhost/dxs:check
cuda_image=localhost/dxs:check-cuda
start=$(date +%s)
step() { echo "check-container: [$(($(date +%s) - start))s] $*"; }
fail() { echo "check-container: FAIL: $*" >&2; exit 1; }

for tool in podman debootstrap; do
  if ! command -v $tool >/dev/null; then
    step "installing $tool"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $tool
  fi
done

mkdir -p "$work"
if [ "${DXS_CONTAINER_FRESH:-0}" = 1 ]; then
  rm -rf --one-file-system "$work/base"
  podman image rm -f "$base_image" >/dev/null 2>&1 || true
fi
if [ ! -x "$work/base/bin/sh" ]; then
  step "debootstrap --variant=minbase bookworm from $mirror"
  rm -rf --one-file-system "$work/base.tmp"
  debootstrap --variant=minbase bookworm "$work/base.tmp" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log" >&2; fail "debootstrap failed (log: $work/debootstrap.log)"; }
  rm -rf "$work/base.tmp/var/cache/apt/archives/"*.deb
  mv "$work/base.tmp" "$work/base"
  podman image rm -f "$base_image" >/dev/null 2>&1 || true
else
  step "reusing the Debian 12 base in $work/base"
fi
if ! podman image exists "$base_image"; then
  step "podman import $work/base as $base_image"
  tar -C "$work/base" --numeric-owner -c . |
    podman import -q --change 'CMD ["/bin/bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      - "$base_image" >/dev/null
fi

version=$(sed -n 's/^project(dxs VERSION \([0-9.]*\).*/\1/p' "$repo/CMakeLists.txt")
commit=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
# --layers: the cuda target's build takes the build and runtime stages from the cpu
# target's (the same steps with the same arguments) instead of running apt again. The layers
# are this run's own: the prebuilt binaries' mount point names them (below), so another
# run's cache is never taken for them, and cleanup removes every image this run made.
build_args=(--isolation chroot --layers -f "$repo/deploy/container/Dockerfile"
  --ignorefile "$repo/deploy/container/Dockerfile.dockerignore"
  --build-arg "DEBIAN_IMAGE=$base_image" --build-arg "DXS_VERSION=$version"
  --build-arg "DXS_GIT_COMMIT=$commit")
# A machine behind a TLS-intercepting proxy trusts the proxy's CA through PIP_CERT (or
# REQUESTS_CA_BUNDLE); setup.sh's pip in the build stage needs the same bundle.
ca_bundle=${DXS_BUILD_CA_BUNDLE:-${PIP_CERT:-${REQUESTS_CA_BUNDLE:-}}}
if [ -n "$ca_bundle" ] && [ -f "$ca_bundle" ]; then
  build_args+=(-v "$ca_bundle:/run/dxs-host-ca.pem:ro" --build-arg PIP_CERT=/run/dxs-host-ca.pem)
  step "build stage: pip trusts the host's CA bundle $ca_bundle"
fi
if [ -n "${DXS_PREBUILT_BIN:-}" ]; then
  prebuilt=$(cd "$DXS_PREBUILT_BIN" && pwd)
  for b in dxs dxs-router dxs-attention dxs-expert; do
    [ -x "$prebuilt/$b" ] || fail "DXS_PREBUILT_BIN=$prebuilt has no $b"
  done
  # DXS_PREBUILT_BIN is an argument of the build stage's RUN, so a mount point that changes
  # with the binaries (names, sizes, times) keeps a layer cache from serving older ones.
  # (stat fails for a missing libdxs_cuda.so, a CPU build's case: not the pipeline's status.)
  stamp=$(cd "$prebuilt" && { stat -c '%n %s %Y' -- dxs dxs-router dxs-attention dxs-expert \
    libdxs_cuda.so 2>/dev/null || true; } | md5sum | cut -c1-12)
  build_args+=(-v "$prebuilt:/prebuilt-$stamp:ro" --build-arg "DXS_PREBUILT_BIN=/prebuilt-$stamp")
  step "podman build (build stage: dependencies and configure; binaries from $prebuilt)"
else
  build_args+=(--no-cache)
  step "podman build (the build stage compiles dxs)"
fi

runtime=$work/rootfs
cuda_root=$work/rootfs-cuda
podman images -a -q --no-trunc | sort -u >"$work/images.before"
cleanup() {
  if [ "${DXS_CHECK_KEEP:-0}" != 1 ]; then
    rm -rf --one-file-system "$runtime" "$cuda_root"
    podman image rm -f "$image" "$cuda_image" >/dev/null 2>&1 || true
  fi
  # The intermediate images of --layers that this run made and that are left (removing a
  # tagged image removes its untagged parents; those of a failed build stay).
  for _ in 1 2 3; do
    new=$(podman images -a -q --no-trunc | sort -u | comm -13 "$work/images.before" -)
    [ -n "$new" ] || break
    # shellcheck disable=SC2086  # one image per word
    podman image rm $new >/dev/null 2>&1 || true
  done
}
trap cleanup EXIT

# podman_build LOG IMAGE [more podman build arguments]: the full output goes to LOG; the
# steps are shown as they go.
podman_build() {
  local log=$1 tag=$2
  shift 2
  if ! podman build "${build_args[@]}" -t "$tag" "$@" "$repo" 2>&1 | tee "$log" |
    grep --line-buffered -E '^(STEP |build-steps|cuda-steps|setup:|-- dxs:|COMMIT|Successfully)' |
    sed -u 's/^/  | /'; then
    tail -40 "$log" >&2
    fail "podman build failed (log: $log)"
  fi
}
podman_build "$work/build.log" "$image"
podman image inspect "$image" >"$work/image.json"

step "image metadata"
meta() { python3 -c 'import json,sys; c=json.load(open(sys.argv[1]))[0]["Config"]; print(eval(sys.argv[2]))' "$work/image.json" "$1"; }
user=$(meta 'c.get("User", "")')
[ "$user" = "10001:10001" ] || fail "USER is '$user', not 10001:10001"
entrypoint=$(meta '" ".join(c.get("Entrypoint") or [])')
[ "$entrypoint" = /usr/local/bin/dxs-entrypoint ] || fail "ENTRYPOINT is '$entrypoint'"
ports=$(meta '" ".join(sorted(c.get("ExposedPorts") or {}))')
[ "$ports" = "50051/tcp 8000/tcp 9100/tcp" ] || fail "exposed ports are '$ports', not 50051/tcp 8000/tcp 9100/tcp"
labels=$(meta 'c.get("Labels") or {}')
for label in title description version revision; do
  meta "c.get('Labels', {}).get('org.opencontainers.image.$label', '')" | grep -q . ||
    fail "no label org.opencontainers.image.$label (labels: $labels)"
done
[ "$(meta "c['Labels']['org.opencontainers.image.version']")" = "$version" ] || fail "version label is not $version"
[ "$(meta "c['Labels']['org.opencontainers.image.revision']")" = "$commit" ] || fail "revision label is not $commit"
echo "  USER $user, ENTRYPOINT $entrypoint, CMD $(meta '" ".join(c.get("Cmd") or [])'), EXPOSE $ports"
echo "  labels: $labels"

step "podman export: the image's file system"
# export_root IMAGE DIR
export_root() {
  rm -rf --one-file-system "$2"
  mkdir -p "$2"
  local container
  container=$(podman create "$1")
  podman export "$container" | tar -C "$2" --numeric-owner -x
  podman rm "$container" >/dev/null
}
export_root "$image" "$runtime"

in_runtime() { python3 "$runner" --root "$runtime" --image-config "$work/image.json" "$@"; }

step "image: user"
echo "  USER $user: $(in_runtime -- id)"

step "image: packages"
chroot "$work/base" dpkg-query -W -f '${Package}\n' | sort >"$work/base.packages"
# check_files ROOT NAME: Debian packages beyond the base (none for building), the binaries,
# nothing else of the build stage; writes NAME.packages.
check_files() {
  local root=$1 name=$2 f bad
  chroot "$root" dpkg-query -W -f '${Package}\n' | sort >"$work/$name.packages"
  echo "  added to debian:bookworm: $(comm -13 "$work/base.packages" "$work/$name.packages" | tr '\n' ' ')"
  bad=$(comm -13 "$work/base.packages" "$work/$name.packages" |
    grep -E -- '-dev$|^(gcc|g\+\+|cpp|clang|llvm|cmake|ninja-build|make|binutils|protobuf-compiler)' || true)
  [ -z "$bad" ] || fail "build-only packages in the image: $bad"
  for f in /usr/local/bin/dxs /usr/local/bin/dxs-router /usr/local/bin/dxs-attention \
    /usr/local/bin/dxs-expert /usr/local/bin/dxs-entrypoint /usr/local/bin/smg /opt/smg/bin/smg; do
    [ -x "$root$f" ] || fail "$f missing from the image"
  done
  if [ -e "$root/src" ] || [ -e "$root/opt/dxs" ]; then
    fail "build stage files leaked into the image"
  fi
  du -sh --exclude=proc --exclude=sys --exclude=dev "$root" | awk '{print "  image root: " $1}'
}
check_files "$runtime" runtime

step "image: shared libraries"
missing=$(in_runtime -- /bin/sh -c 'for b in /usr/local/bin/dxs*; do
  case $b in *entrypoint) continue;; esac; ldd "$b" | sed "s|^|$b: |"; done' | grep "not found" || true)
[ -z "$missing" ] || fail "missing shared libraries: $missing"
echo "  ldd: every library of dxs, dxs-router, dxs-attention, dxs-expert found"

step "image: binaries start as $user"
in_runtime -- dxs help >/dev/null || fail "dxs help"
in_runtime -- dxs-entrypoint help >/dev/null || fail "dxs-entrypoint help (the image's CMD)"
in_runtime -- dxs-router --help >/dev/null || fail "dxs-router --help"
in_runtime -- /bin/sh -c 'test ! -w /usr/local/bin/dxs-router' || fail "the binaries are writable by $user"
in_runtime -- smg --help >/dev/null || fail "smg --help"
in_runtime -- smg launch --help >/dev/null || fail "smg launch --help"
in_runtime -- /bin/sh -c 'test ! -w /opt/smg/bin/smg && test ! -w /opt/smg' || fail "the gateway's venv is writable by $user"
echo "  dxs help, dxs-router --help, dxs-entrypoint help, smg --help, smg launch --help: exit 0;" \
  "binaries and /opt/smg read-only to $user ($(in_runtime -- /opt/smg/bin/pip show smg | sed -n 's/^Version: /smg /p'))"

step "image: the SMG gateway starts as $user (smg launch as deploy/k8s runs it, no worker)"
# deploy/k8s/base/gateway.yaml's flags, on loopback with kernel-chosen ports and a worker
# that is not there: it serves HTTP (/liveness 200), is not ready (/readiness 503: no healthy
# worker) and serves its metrics; then SIGTERM stops it.
read -r gw_port gw_metrics gw_worker < <(python3 -c 'import socket
ss = [socket.socket() for _ in range(3)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in ss))')
gateway_smoke='
set -eu
w=/tmp/dxs-gateway-smoke
rm -rf "$w" && mkdir -p "$w"
smg launch --worker-urls grpc://127.0.0.1:$GW_WORKER --host 127.0.0.1 --port $GW_PORT \
  --prometheus-host 127.0.0.1 --prometheus-port $GW_METRICS --policy least_load >"$w/smg.log" 2>&1 &
pid=$!
trap "kill -KILL $pid 2>/dev/null || true" EXIT
get() {  # PORT PATH: the status line and body, over bash /dev/tcp (no HTTP client here)
  bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; printf \"GET $2 HTTP/1.0\r\nHost: x\r\n\r\n\" >&3; cat <&3" 2>/dev/null
}
ok=0
for i in $(seq 1 60); do
  # Each reply into a file first: a pipe that closes early fails under pipefail (SIGPIPE).
  get $GW_PORT /liveness >"$w/liveness" || true
  if head -1 "$w/liveness" | grep -q " 200"; then ok=1; break; fi
  kill -0 $pid 2>/dev/null || break
  sleep 0.5
done
if [ $ok != 1 ]; then tail -20 "$w/smg.log"; echo "  no 200 from /liveness"; exit 1; fi
get $GW_PORT /readiness >"$w/readiness" || true
head -1 "$w/readiness" | grep -q " 503" || { echo "  /readiness is not 503 without a worker"; exit 1; }
get $GW_METRICS /metrics >"$w/metrics"
grep -q "^smg_http_requests_total{.*path=\"/liveness\"" "$w/metrics" ||
  { head -20 "$w/metrics"; echo "  no smg_http_requests_total for /liveness"; exit 1; }
echo "  /liveness 200, /readiness 503, /metrics: $(grep -c "^smg_" "$w/metrics") smg_ samples"
kill -TERM $pid
i=0
while kill -0 $pid 2>/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
if kill -0 $pid 2>/dev/null; then echo "  smg ignored SIGTERM for 30 s"; exit 1; fi
echo "  stopped on SIGTERM after $((i / 10)) s"
'
in_runtime --env "GW_PORT=$gw_port" --env "GW_METRICS=$gw_metrics" --env "GW_WORKER=$gw_worker" \
  -- /bin/sh -c "$gateway_smoke" || fail "the gateway smoke test failed"

# expect_cuda_error PATTERN RUNNER...: `dxs run --device cuda` through RUNNER (in_runtime,
# in_cuda) must exit 1 with one line on stderr that matches PATTERN: not a crash, not a hang
# (timeout's 124).
expect_cuda_error() {
  local pattern=$1 rc=0 err
  shift
  err=$("$@" -- timeout 120 dxs run --device cuda --max-new-tokens 1 --prompt-ids 1 2>&1 >/dev/null) || rc=$?
  [ "$rc" = 1 ] || fail "dxs run --device cuda: exit status $rc, not 1: $err"
  [ "$(printf '%s\n' "$err" | wc -l)" = 1 ] || fail "dxs run --device cuda: not one line: $err"
  printf '%s\n' "$err" | grep -q -E "$pattern" || fail "dxs run --device cuda: '$err' does not match '$pattern'"
  echo "  dxs run --device cuda: exit 1, $err"
}
# The binaries may be a CUDA build (DXS_PREBUILT_BIN from a machine with the toolkit); this
# image has no plugin either way.
expect_cuda_error '^dxs run: --device cuda: (this build of dxs has no CUDA backend|cannot load the CUDA backend /usr/local/bin/libdxs_cuda.so: )' in_runtime

step "image: a 2 DP x 2 EP cluster through dxs-entrypoint, as $user"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
# The UCX settings the Kubernetes pods get (deploy/k8s/base/cluster.env).
ucx_env=()
while IFS= read -r kv; do ucx_env+=(--env "$kv"); done < <(grep -E '^UCX_[A-Z_]+=' "$repo/deploy/k8s/base/cluster.env")
smoke='
set -eu
w=/tmp/dxs-smoke
rm -rf "$w" && mkdir -p "$w"
pids=""
workers=""
stop_all() {
  for p in $pids; do kill -TERM "$p" 2>/dev/null || true; done
  for p in $pids; do
    i=0
    while kill -0 "$p" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    if kill -0 "$p" 2>/dev/null; then echo "  pid $p ignored SIGTERM for 10 s"; kill -KILL "$p"; exit 1; fi
  done
}
trap stop_all EXIT
dxs gen-model --out "$w/model" >/dev/null
# As in the pods, but on loopback with kernel-chosen ports (DXS_*_PORT=0).
export DXS_MODEL_DIR="$w/model" DXS_ATTENTION_RANKS=2 DXS_EXPERT_RANKS=2 DXS_METRICS_PORT=0
export DXS_ROUTER_ADDR=127.0.0.1:$ROUTER_PORT DXS_ADVERTISE_HOST=127.0.0.1
DXS_ROUTER_LISTEN_HOST=127.0.0.1 DXS_GRPC_PORT=$ROUTER_PORT dxs-entrypoint router >"$w/router.log" 2>&1 &
pids="$pids $!"
for r in 0 1; do
  HOSTNAME=dxs-expert-$r DXS_GRPC_PORT=0 dxs-entrypoint expert >"$w/expert-$r.log" 2>&1 &
  pids="$pids $!"; workers="$workers $!"
  # A host name (like the FQDN of a pod, resolved through /etc/hosts) for the attention ranks.
  POD_INDEX=$r HOSTNAME=dxs-attention-x DXS_ADVERTISE_HOST=localhost DXS_GRPC_PORT=0 \
    dxs-entrypoint attention >"$w/attention-$r.log" 2>&1 &
  pids="$pids $!"; workers="$workers $!"
done
ok=0
for i in $(seq 1 120); do
  if dxs generate --router 127.0.0.1:$ROUTER_PORT --prompt-ids 1,2,3 --max-new-tokens 4 >"$w/generate.out" 2>&1; then ok=1; break; fi
  sleep 0.5
done
if [ $ok != 1 ]; then
  for f in "$w"/*.log "$w/generate.out"; do echo "== $f"; tail -5 "$f"; done
  exit 1
fi
echo "  dxs generate: $(tr "\n" " " <"$w/generate.out")"
dxs status --router 127.0.0.1:$ROUTER_PORT | sed "s/^/  status | /"
grep -h "^dxs-entrypoint: exec" "$w"/*.log | sed "s/^/  /"

# /metrics of every process (the port from its "metrics on HOST:PORT" line), over bash
# /dev/tcp since the image has no HTTP client.
for f in "$w"/*.log; do
  mport=$(sed -n "s/.*metrics on [^ ]*:\([0-9][0-9]*\).*/\1/p" "$f" | head -1)
  [ -n "$mport" ] || { echo "  no metrics address in $f"; exit 1; }
  bash -c "exec 3<>/dev/tcp/127.0.0.1/$mport; printf \"GET /metrics HTTP/1.0\r\n\r\n\" >&3; cat <&3" \
    >"${f%.log}.metrics"
  grep -q "^dxs_build_info{" "${f%.log}.metrics" || { echo "  no dxs_build_info from $f"; exit 1; }
  echo "  $(basename "$f" .log): /metrics on port $mport, $(grep -c "^dxs_" "${f%.log}.metrics") samples"
done

# UCX listens only inside UCX_TCP_PORT_RANGE (what the NetworkPolicy opens): every
# listening TCP port of a worker is its gRPC port, its metrics port, or in that range.
lo=${UCX_TCP_PORT_RANGE%-*}; hi=${UCX_TCP_PORT_RANGE#*-}
for p in $workers; do
  inodes=" $(ls -l /proc/$p/fd 2>/dev/null | sed -n "s/.*socket:\[\([0-9]*\)\].*/\1/p" | tr "\n" " ") "
  ports=""
  for hex in $(cat /proc/net/tcp /proc/net/tcp6 2>/dev/null |
    awk -v ino="$inodes" "\$4 == \"0A\" && index(ino, \" \" \$10 \" \") { split(\$2, a, \":\"); print a[2] }" | sort -u); do
    ports="$ports $(printf "%d" "0x$hex")"
  done
  in_range=0
  for port in $ports; do
    if [ "$port" -ge "$lo" ] && [ "$port" -le "$hi" ]; then in_range=$((in_range + 1)); continue; fi
    if grep -q -e "listening on [^ ]*:$port[ ,]" -e "metrics on [^ ]*:$port\$" "$w"/*.log; then continue; fi
    echo "  pid $p listens on $port: neither gRPC, metrics nor UCX_TCP_PORT_RANGE $UCX_TCP_PORT_RANGE"; exit 1
  done
  [ $in_range -gt 0 ] || { echo "  pid $p: no UCX listener in $UCX_TCP_PORT_RANGE (ports:$ports)"; exit 1; }
  echo "  worker pid $p listens on$ports (UCX: $in_range in $UCX_TCP_PORT_RANGE)"
done
'
in_runtime --env "ROUTER_PORT=$port" "${ucx_env[@]}" -- /bin/sh -c "$smoke" || fail "the cluster smoke test failed"
echo "  every process exited on SIGTERM (UCX env from cluster.env: ${ucx_env[*]})"

# The dashboard's metric names against what the binaries expose (a note, not a failure:
# the metrics are still being added).
python3 - "$repo/deploy/grafana/dxs-dashboard.json" "$runtime/tmp/dxs-smoke" <<'PY'
import glob, json, re, sys
exposed = set()
for f in glob.glob(sys.argv[2] + "/*.metrics"):
    exposed |= set(re.findall(r"^(dxs_[a-z0-9_]+)", open(f).read(), re.M))
dash = json.load(open(sys.argv[1]))
used = {m for p in dash["panels"] for t in p.get("targets", []) for m in re.findall(r"\b(dxs_[a-z0-9_]+)", t["expr"])}
missing = sorted(used - exposed)
print(f"  dashboard: {len(used)} series names used, {len(used) - len(missing)} exposed by these binaries"
      + (f"; not (yet) exposed: {', '.join(missing)}" if missing else ""))
PY

# The CUDA image (--target cuda): what it adds to the image above, without a GPU.
if [ -z "${DXS_PREBUILT_BIN:-}" ]; then
  step "CUDA image: skipped (it needs binaries built with the CUDA toolkit: DXS_PREBUILT_BIN)"
elif [ ! -f "$prebuilt/libdxs_cuda.so" ]; then
  step "CUDA image: skipped ($prebuilt has no libdxs_cuda.so: not built with the CUDA toolkit)"
else
  step "podman build --target cuda (the stages above from the layer cache; cuBLAS from PyPI)"
  podman_build "$work/build-cuda.log" "$cuda_image" --target cuda
  podman image inspect "$cuda_image" >"$work/image-cuda.json"
  in_cuda() { python3 "$runner" --root "$cuda_root" --image-config "$work/image-cuda.json" "$@"; }

  step "CUDA image: metadata"
  python3 - "$work/image.json" "$work/image-cuda.json" <<'PY' || fail "CUDA image metadata"
import json, sys
cpu, cuda = (json.load(open(f))[0]["Config"] for f in sys.argv[1:])
for k in ("User", "Entrypoint", "Cmd", "ExposedPorts", "WorkingDir"):
    if cpu.get(k) != cuda.get(k):
        sys.exit(f"  {k}: {cuda.get(k)!r}, the CPU image has {cpu.get(k)!r}")
env = set(cuda.get("Env") or [])
if not set(cpu.get("Env") or []) <= env or "NVIDIA_DRIVER_CAPABILITIES=compute,utility" not in env:
    sys.exit(f"  Env: {sorted(env)}")
labels = cuda.get("Labels") or {}
if "CUDA" not in labels.get("org.opencontainers.image.description", ""):
    sys.exit(f"  the description label does not say CUDA: {labels}")
for k in ("version", "revision", "title"):
    k = "org.opencontainers.image." + k
    if labels.get(k) != (cpu.get("Labels") or {}).get(k):
        sys.exit(f"  label {k}: {labels.get(k)!r}")
print("  as the CPU image (USER, ENTRYPOINT, CMD, EXPOSE, labels), plus",
      " ".join(sorted(e for e in env if e.startswith("NVIDIA_"))))
PY

  step "CUDA image: file system"
  export_root "$cuda_image" "$cuda_root"
  check_files "$cuda_root" cuda
  cmp -s "$work/runtime.packages" "$work/cuda.packages" ||
    fail "the cuda target changed the Debian packages: $(diff "$work/runtime.packages" "$work/cuda.packages" | tr '\n' ' ')"
  for f in /usr/local/bin/libdxs_cuda.so /usr/local/lib/dxs/libcublas.so.13 \
    /usr/local/lib/dxs/libcublasLt.so.13; do
    [ -f "$cuda_root$f" ] || fail "$f missing from the CUDA image"
  done
  ls "$cuda_root"/usr/local/lib/dxs/libcudart-*.so.* >/dev/null 2>&1 ||
    fail "no libcudart-*.so.* (UCX's libucm_cuda.so.0 links it) in /usr/local/lib/dxs"
  driver=$(find "$cuda_root" -xdev \( -name 'libcuda.so*' -o -name 'libnvidia-ml.so*' \) | sed "s|^$cuda_root||")
  [ -z "$driver" ] || fail "driver libraries in the image (the node's NVIDIA toolkit mounts them): $driver"
  (cd "$cuda_root/usr/local" && du -ch bin/libdxs_cuda.so lib/dxs/libcublas*.so.13 lib/dxs/libcudart-* |
    awk '{print "  " $2 ": " $1}')

  step "CUDA image: shared libraries (all but the driver's libcuda.so.1, libnvidia-ml.so.1)"
  in_cuda -- /bin/sh -c 'for f in /usr/local/bin/dxs /usr/local/bin/dxs-attention \
    /usr/local/bin/dxs-expert /usr/local/bin/dxs-router /usr/local/bin/libdxs_cuda.so \
    /usr/local/lib/dxs/*.so* /usr/local/lib/dxs/ucx/*.so*; do
    ldd "$f" | sed "s|^|$f: |"; done' >"$work/cuda.ldd" || fail "ldd in the CUDA image"
  missing=$(grep "not found" "$work/cuda.ldd" | grep -v -E ':\s+(libcuda|libnvidia-ml)\.so\.1 => not found' || true)
  [ -z "$missing" ] || fail "missing shared libraries: $missing"
  echo "  ldd: every library of the binaries, libdxs_cuda.so, cuBLAS and UCX found; the driver's:" \
    "$(grep -E ':\s+lib(cuda|nvidia-ml)\.so\.1 => not found' "$work/cuda.ldd" | sed 's|:.*/||; s|:\s*| needs |; s| =>.*||' | sort -u | tr '\n' ',' | sed 's/,$//; s/,/, /g')"
  # dlopen("libcublas.so.13"), as the plugin calls it, goes through ld.so's cache: load both
  # by name into a process as the user (ld.so warns and goes on when one cannot be loaded).
  # Into a file first: with pipefail, grep -q closing the pipe at its match would fail the
  # pipeline whenever ldconfig was still writing (SIGPIPE).
  in_cuda -- /sbin/ldconfig -p >"$work/cuda.ldconfig" || fail "ldconfig -p in the CUDA image"
  grep -q 'libcublasLt.so.13 .*=> /usr/local/lib/dxs/' "$work/cuda.ldconfig" ||
    fail "libcublasLt.so.13 is not in the image's ld.so cache"
  err=$(in_cuda --env "LD_PRELOAD=libcublas.so.13 libcublasLt.so.13" -- dxs help 2>&1 >/dev/null) ||
    fail "dxs help with cuBLAS preloaded: $err"
  [ -z "$err" ] || fail "cuBLAS does not load by name as $user: $err"
  echo "  libcublas.so.13 and libcublasLt.so.13 load by name (ld.so cache) as $user"

  step "CUDA image: dxs run, as $user, with no GPU and no driver"
  # The plugin loads (its own error, not make_backend.cc's "cannot load the CUDA backend")
  # and reports that there is no GPU; cuBLAS is loaded only once a GPU is there.
  expect_cuda_error '^dxs run: --device cuda: no usable GPU \(' in_cuda
  tokens=$(in_cuda -- timeout 120 dxs run --max-new-tokens 2 --prompt-ids 1,2,3 2>/dev/null) ||
    fail "dxs run on the CPU in the CUDA image"
  echo "  dxs run on the CPU: tokens $tokens"
fi

step "OK: podman built the image(s) and they work (work dir $work)"
