#!/bin/sh
# HOSTNAME is not POSIX, but container runtimes set it (to the pod name in Kubernetes).
# shellcheck disable=SC3028

# dxs-entrypoint: starts one dxs service with its flags taken from the environment, the way
# the Kubernetes manifests in deploy/k8s set it (the dxs-config ConfigMap plus the downward
# API). Installed in the image as /usr/local/bin/dxs-entrypoint.
#
#   dxs-entrypoint router|attention|expert [more flags for the binary...]
#   dxs-entrypoint dxs COMMAND [flags...]   the dxs CLI (dxs generate, dxs status, ...)
#   dxs-entrypoint help                     this usage and `dxs help` (the image's CMD)
#
# Environment ([default]):
#   DXS_MODEL_DIR          checkpoint directory                            [/models/default]
#   DXS_GRPC_PORT          this service's gRPC port                        [50051]
#   DXS_METRICS_PORT       Prometheus port: --metrics-listen 0.0.0.0:PORT; empty: no flag []
#   router:    DXS_ATTENTION_RANKS (M) [1], DXS_EXPERT_RANKS (N) [1], DXS_WIRE_DTYPE [f32],
#              DXS_TRANSPORT [ucx], DXS_LEASE_MS, DXS_HEARTBEAT_MS, DXS_MAX_INFLIGHT
#              (unset: the binary's defaults), DXS_ROUTER_LISTEN_HOST [0.0.0.0]
#   workers:   DXS_ROUTER_ADDR  the router's control plane              [dxs-router-cp:50051]
#              DXS_RANK         the rank; unset: POD_INDEX (the pod's apps.kubernetes.io/
#                               pod-index label, through the downward API), else the ordinal
#                               that ends HOSTNAME (a StatefulSet pod is NAME-ORDINAL)
#              DXS_ADVERTISE_HOST  the host the worker listens on and registers with the
#                               router, so it must be reachable from the other pods; unset:
#                               the pod's FQDN (`hostname -f`, which kubelet puts in
#                               /etc/hosts for a StatefulSet pod with a headless Service:
#                               NAME-0.SERVICE.NAMESPACE.svc.cluster.local), else POD_IP
#              DXS_DEVICE       --device cpu|cuda[:N]: where the worker computes (unset: cpu)
#   attention: DXS_KV_TOKENS, DXS_PREFILL_CHUNK, DXS_OVERLAP_MIN_TOKENS (0: no two-batch
#              overlap), DXS_STREAM_INTERVAL (tokens per streamed chunk after the first)
#              (unset: the binary's defaults)
#   expert:    DXS_EXPERTS      --experts LIST    (unset: the contiguous block of the rank)
#   TLS:       DXS_TLS_DIR      a directory with tls.crt, tls.key and ca.crt (a Secret as
#                               cert-manager writes it); set: --tls-cert/--tls-key/--tls-ca
#              DXS_MTLS=1       adds --mtls
#
# Prints the command line on stderr, then execs it: the binary takes the shell's place (PID 1
# in a container), so SIGTERM reaches it directly.
set -euf

usage() {
  echo "usage: dxs-entrypoint router|attention|expert [flags...] | dxs COMMAND [flags...] | help" >&2
  exit 2
}

[ $# -ge 1 ] || usage
role=$1
shift
case $role in
  help | -h | --help)
    echo "usage: dxs-entrypoint router|attention|expert [flags...] | dxs COMMAND [flags...] | help"
    echo "  router, attention, expert: start that service with its flags from the environment"
    echo "  (see /usr/local/bin/dxs-entrypoint); dxs: the command-line tool:"
    exec dxs help
    ;;
  dxs) exec dxs "$@" ;;
esac

model=${DXS_MODEL_DIR:-/models/default}
grpc_port=${DXS_GRPC_PORT:-50051}

# Common flags, collected in the positional parameters after the caller's own flags.
extra_flags() {
  if [ -n "${DXS_METRICS_PORT:-}" ]; then
    printf '%s\n' --metrics-listen "0.0.0.0:${DXS_METRICS_PORT}"
  fi
  if [ -n "${DXS_TLS_DIR:-}" ]; then
    printf '%s\n' --tls-cert "${DXS_TLS_DIR}/tls.crt" --tls-key "${DXS_TLS_DIR}/tls.key" \
      --tls-ca "${DXS_TLS_DIR}/ca.crt"
    if [ "${DXS_MTLS:-0}" = 1 ]; then printf '%s\n' --mtls; fi
  fi
}

worker_rank() {
  if [ -n "${DXS_RANK:-}" ]; then
    rank=$DXS_RANK
  elif [ -n "${POD_INDEX:-}" ]; then
    rank=$POD_INDEX
  else
    host=${HOSTNAME:-$(hostname)}
    rank=${host##*-}
  fi
  case $rank in
    '' | *[!0-9]*)
      echo "dxs-entrypoint: cannot tell the rank (DXS_RANK, POD_INDEX, HOSTNAME=${HOSTNAME:-}):" \
        "got '$rank'" >&2
      exit 2
      ;;
  esac
  echo "$rank"
}

advertise_host() {
  if [ -n "${DXS_ADVERTISE_HOST:-}" ]; then
    echo "$DXS_ADVERTISE_HOST"
    return
  fi
  fqdn=$(hostname -f 2>/dev/null || true)
  case $fqdn in
    *.*) echo "$fqdn" ;;
    *)
      if [ -n "${POD_IP:-}" ]; then echo "$POD_IP"; else
        echo "dxs-entrypoint: no FQDN from 'hostname -f' and no POD_IP;" \
          "set DXS_ADVERTISE_HOST" >&2
        exit 2
      fi
      ;;
  esac
}

# Appends "--flag value" when the variable is set and not empty.
opt() {
  if [ -n "$2" ]; then printf '%s\n' "$1" "$2"; fi
}

# Builds the argument list one line per argument (no argument contains a newline), then
# turns it into "$@" so that values with spaces survive.
case $role in
  router)
    bin=dxs-router
    args=$(
      printf '%s\n' --model "$model" --listen "${DXS_ROUTER_LISTEN_HOST:-0.0.0.0}:${grpc_port}" \
        --attention "${DXS_ATTENTION_RANKS:-1}" --experts "${DXS_EXPERT_RANKS:-1}" \
        --wire-dtype "${DXS_WIRE_DTYPE:-f32}" --transport "${DXS_TRANSPORT:-ucx}"
      opt --lease-ms "${DXS_LEASE_MS:-}"
      opt --heartbeat-ms "${DXS_HEARTBEAT_MS:-}"
      opt --max-inflight "${DXS_MAX_INFLIGHT:-}"
    )
    ;;
  attention | expert)
    bin=dxs-$role
    rank=$(worker_rank)
    host=$(advertise_host)
    args=$(
      printf '%s\n' --model "$model" --rank "$rank" \
        --router "${DXS_ROUTER_ADDR:-dxs-router-cp:50051}" --listen "${host}:${grpc_port}"
      opt --device "${DXS_DEVICE:-}"
      if [ "$role" = attention ]; then
        opt --kv-tokens "${DXS_KV_TOKENS:-}"
        opt --prefill-chunk "${DXS_PREFILL_CHUNK:-}"
        opt --overlap-min-tokens "${DXS_OVERLAP_MIN_TOKENS:-}"
        opt --stream-interval "${DXS_STREAM_INTERVAL:-}"
      else
        opt --experts "${DXS_EXPERTS:-}"
      fi
    )
    ;;
  *) usage ;;
esac
args="$args
$(extra_flags)"

old_ifs=$IFS
IFS='
'
# shellcheck disable=SC2086  # split on newlines only, on purpose
set -- $args "$@"
IFS=$old_ifs

echo "dxs-entrypoint: exec $bin $*" >&2
exec "$bin" "$@"
