#!/usr/bin/env bash
# Renders every Kubernetes overlay of deploy/k8s and validates the result offline:
#   - built-in kinds against the Kubernetes ${DXS_K8S_VERSION:-1.30} schemas, strictly, with
#     kubernetes-validate (PyPI; installed into the project's .venv when missing);
#   - PodMonitor/ServiceMonitor against the Prometheus Operator CRDs in ../shared/schemas;
#   - dxs invariants (replicas = M/N, ports and probes, selectors, network policies) and the
#     Grafana dashboard (parses, every panel has targets, PromQL parses with promtool).
# Overlays: overlays/cpu-demo, overlays/gpu, and cpu-demo with components/tls.
# Exit status 1 on any problem. Needs no cluster and no network once .venv is set up.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
k8s_version=${DXS_K8S_VERSION:-1.30}
schemas=${DXS_SCHEMAS_DIR:-$repo/../shared/schemas}
venv=${DXS_PY_VENV:-$repo/.venv}

# kubectl with a kustomize new enough for components, replacements and labels (v5; kubectl
# 1.27+). Debian 12's kubernetes-client (1.20) is the fallback, and is too old: say so.
kubectl=${KUBECTL:-}
if [ -z "$kubectl" ]; then
  if [ -x /usr/bin/kubectl ]; then kubectl=/usr/bin/kubectl
  elif command -v kubectl >/dev/null; then kubectl=$(command -v kubectl)
  else
    echo "check-deploy: no kubectl; installing Debian's kubernetes-client"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends kubernetes-client
    kubectl=$(command -v kubectl)
  fi
fi
kustomize_version=$("$kubectl" version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\{0,1\}//p')
case $kustomize_version in
  [5-9].*) ;;
  *)
    echo "check-deploy: $kubectl has kustomize '${kustomize_version:-unknown}'; deploy/k8s needs" \
      "kustomize v5 (kubectl 1.27 or later). Set KUBECTL=/path/to/kubectl." >&2
    exit 1
    ;;
esac

if [ ! -d "$schemas" ]; then
  echo "check-deploy: no CRD schemas at $schemas (set DXS_SCHEMAS_DIR)" >&2
  exit 1
fi
if ! "$venv/bin/python3" -c "import kubernetes_validate, jsonschema, yaml" 2>/dev/null; then
  echo "check-deploy: installing kubernetes-validate into $venv"
  [ -x "$venv/bin/python3" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==1.37.0"
fi

out=$(mktemp -d /tmp/dxs-check-deploy.XXXXXX)
trap 'rm -rf "$out"' EXIT

render() {  # NAME KUSTOMIZATION_DIR
  if ! "$kubectl" kustomize "$2" >"$out/$1.yaml" 2>"$out/$1.err"; then
    echo "check-deploy: kubectl kustomize $2 failed:" >&2
    cat "$out/$1.err" >&2
    exit 1
  fi
  echo "check-deploy: rendered $2 -> $1.yaml ($(grep -c '^kind:' "$out/$1.yaml") objects)"
}
render cpu-demo deploy/k8s/overlays/cpu-demo
render gpu deploy/k8s/overlays/gpu
# The TLS component on top of cpu-demo, as docs/deploy.md shows it (kustomize wants
# relative paths to other kustomizations).
mkdir -p "$out/cpu-demo-tls"
rel=$(python3 -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$repo/deploy/k8s" "$out/cpu-demo-tls")
cat >"$out/cpu-demo-tls/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $rel/overlays/cpu-demo
components:
  - $rel/components/tls
YAML
render cpu-demo-tls "$out/cpu-demo-tls"

"$venv/bin/python3" deploy/k8s/validate.py --kubernetes-version "$k8s_version" --crds "$schemas" \
  --dashboard deploy/grafana/dxs-dashboard.json --metrics-doc docs/metrics.md \
  "$out/cpu-demo.yaml" "$out/gpu.yaml" "$out/cpu-demo-tls.yaml"
echo "check-deploy: OK"
