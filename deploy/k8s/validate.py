#!/usr/bin/env python3
"""Offline checks of rendered dxs manifests and of the Grafana dashboard.

  validate.py --kubernetes-version 1.30 --crds DIR --dashboard FILE RENDERED.yaml...

scripts/check-deploy.sh renders the overlays with `kubectl kustomize` and runs this on the
output. For every file:
  - built-in kinds against the Kubernetes JSON schemas of `kubernetes-validate` (strict:
    unknown fields are errors);
  - custom resources (PodMonitor, ServiceMonitor, ...) against the openAPIV3Schema of their
    CustomResourceDefinition in --crds, made strict the same way (an object schema that
    lists its properties rejects others unless it preserves unknown fields);
  - dxs's own invariants: StatefulSet replicas equal M and N from the dxs-config
    ConfigMap; ports and gRPC probes agree with DXS_GRPC_PORT / DXS_METRICS_PORT;
    Services, PodDisruptionBudgets, NetworkPolicies and the PodMonitor select pods that
    exist; the metrics port is reachable only from the monitoring namespace, the UCX port
    range of the ConfigMap is open between dxs pods; with DXS_DEVICE=cuda every image is a
    CUDA image (tag ending in -cuda); the dashboard ConfigMap carries the Grafana sidecar
    label and the dashboard file's exact content.
And the dashboard: it parses, every panel has targets with an expression, every metric
selector applies the $namespace and $model variables, no Grafana macros, only known dxs
metric names, and (with promtool) every expression parses as PromQL once the variables are
substituted. Prints one line per problem and exits 1 if there was any.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jsonschema
import kubernetes_validate
import yaml

# The metric names dxs exposes (docs/metrics.md); histograms also as _bucket/_sum/_count.
COUNTERS_AND_GAUGES = {
    "dxs_steps_total", "dxs_empty_batch_steps_total", "dxs_tokens_dispatched_total",
    "dxs_queue_length", "dxs_running_requests", "dxs_kv_cache_used_tokens",
    "dxs_kv_cache_capacity_tokens", "dxs_requests_total", "dxs_cluster_empty_ranks",
    "dxs_ep_token_imbalance", "dxs_expert_tokens_total", "dxs_workers", "dxs_build_info",
    "dxs_overlapped_steps_total", "dxs_cluster_ep_balance_ratio", "dxs_placement_version",
    "dxs_placement_experts", "dxs_placement_replicas", "dxs_eplb_rebalances_total",
    "dxs_eplb_experts_moved_total", "dxs_eplb_recoveries_total",
}
HISTOGRAMS = {
    "dxs_dispatch_latency_seconds", "dxs_combine_latency_seconds", "dxs_step_duration_seconds",
    "dxs_time_to_first_token_seconds", "dxs_inter_token_latency_seconds",
    "dxs_request_duration_seconds", "dxs_ep_balance_ratio", "dxs_eplb_recovery_duration_seconds",
}
KNOWN_SERIES = COUNTERS_AND_GAUGES | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
MONITORING_NAMESPACE = "monitoring"

problems = []


def problem(where, message):
    problems.append(f"{where}: {message}")


# ---------------------------------------------------------------- schemas


def strict(schema):
    """Rejects unknown fields in every object schema that lists its properties."""
    if isinstance(schema, dict):
        if (schema.get("type") == "object" and "properties" in schema
                and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for v in schema.values():
            strict(v)
    elif isinstance(schema, list):
        for v in schema:
            strict(v)
    return schema


def load_crds(directory):
    crds = {}  # (group/version, kind) -> validator
    for path in sorted(glob.glob(os.path.join(directory, "*.yaml"))):
        for doc in yaml.safe_load_all(open(path)):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group = doc["spec"]["group"]
            kind = doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                schema = strict(version["schema"]["openAPIV3Schema"])
                crds[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return crds


def validate_schema(doc, where, version, crds):
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in crds:
        for error in sorted(crds[key].iter_errors(doc), key=lambda e: list(e.absolute_path)):
            path = ".".join(str(p) for p in error.absolute_path) or "(root)"
            problem(where, f"{path}: {error.message[:300]}")
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.absolute_path) or "(root)"
        problem(where, f"{path}: {e.message[:300]}")
    except kubernetes_validate.SchemaNotFoundError as e:
        problem(where, f"no schema: {e.message}")


# ---------------------------------------------------------------- dxs invariants


def pod_templates(docs):
    """(workload doc, pod template) for Deployments and StatefulSets."""
    return [(d, d["spec"]["template"]) for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def matches(selector, labels):
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        value, op, values = labels.get(expr["key"]), expr["operator"], expr.get("values", [])
        if (op == "In" and value not in values) or (op == "NotIn" and value in values) or \
           (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


def port_covered(rule_port, port):
    if "port" not in rule_port:
        return True
    start = rule_port["port"]
    if not isinstance(start, int):
        return False  # named ports: dxs uses numbers
    return start <= port <= rule_port.get("endPort", start)


def check_invariants(docs, name, dashboard_text):
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    configs = [c for c in by_kind.get("ConfigMap", []) if c["metadata"]["name"].startswith("dxs-config")]
    if len(configs) != 1:
        problem(name, f"expected one dxs-config ConfigMap, found {len(configs)}")
        return
    config = configs[0]["data"]
    grpc_port = int(config.get("DXS_GRPC_PORT", "0"))
    metrics_port = int(config.get("DXS_METRICS_PORT", "0"))
    cuda = config.get("DXS_DEVICE", "cpu").startswith("cuda")
    templates = pod_templates(docs)

    # M and N: the router's flags and the StatefulSets' sizes come from the same values.
    for sts_name, key in (("dxs-attention", "DXS_ATTENTION_RANKS"), ("dxs-expert", "DXS_EXPERT_RANKS")):
        sts = [d for d in by_kind.get("StatefulSet", []) if d["metadata"]["name"] == sts_name]
        if len(sts) != 1:
            problem(name, f"StatefulSet {sts_name} missing")
            continue
        if str(sts[0]["spec"].get("replicas")) != config.get(key):
            problem(name, f"StatefulSet {sts_name} has {sts[0]['spec'].get('replicas')} replicas, "
                          f"dxs-config {key}={config.get(key)}")
        services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
        svc = services.get(sts[0]["spec"]["serviceName"])
        if not svc or svc["spec"].get("clusterIP") != "None":
            problem(name, f"StatefulSet {sts_name}: serviceName is not a headless Service")
        elif not svc["spec"].get("publishNotReadyAddresses"):
            problem(name, f"Service {svc['metadata']['name']}: workers need DNS names before "
                          "they are Ready (publishNotReadyAddresses)")

    # Every dxs container: ports and probes agree with the ConfigMap, envFrom resolves.
    configmap_names = {c["metadata"]["name"] for c in by_kind.get("ConfigMap", [])}
    for workload, template in templates:
        where = f"{name}: {workload['kind']} {workload['metadata']['name']}"
        spec = template["spec"]
        for c in spec.get("containers", []):
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            if ports.get("grpc") != grpc_port or ports.get("metrics") != metrics_port:
                problem(where, f"container ports {ports} != DXS_GRPC_PORT {grpc_port} / "
                               f"DXS_METRICS_PORT {metrics_port}")
            for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = c.get(probe_name)
                if not probe:
                    problem(where, f"no {probe_name}")
                    continue
                port = (probe.get("grpc") or probe.get("tcpSocket") or {}).get("port")
                if port != grpc_port:
                    problem(where, f"{probe_name} on port {port}, not the gRPC port {grpc_port}")
                if "grpc" in probe and workload["metadata"]["name"] == "dxs-router":
                    # "" is NOT_SERVING until the cluster is complete: a liveness or startup
                    # probe on it would restart the router before any worker could join.
                    want = "dxs.v1.Frontend" if probe_name == "readinessProbe" else "dxs.v1.ControlPlane"
                    if probe["grpc"].get("service") != want:
                        problem(where, f"{probe_name} must probe service {want}")
            for ref in c.get("envFrom", []):
                cm = (ref.get("configMapRef") or {}).get("name")
                if cm and cm not in configmap_names:
                    problem(where, f"envFrom ConfigMap {cm} is not in the output")
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            image = c.get("image", "")
            if ":" not in image.rsplit("/", 1)[-1] and "@" not in image:
                problem(where, f"container {c['name']}: image {image!r} has no tag")
            # --device cuda needs the CUDA image (the Dockerfile's cuda target, tagged
            # VERSION-cuda): the CPU image has no CUDA backend.
            elif cuda and "@" not in image and not image.rsplit(":", 1)[-1].endswith("-cuda"):
                problem(where, f"container {c['name']}: DXS_DEVICE={config['DXS_DEVICE']} "
                               f"needs a CUDA image (tag ...-cuda), not {image!r}")

    # Selectors select something.
    all_pod_labels = [t["metadata"].get("labels", {}) for _, t in templates]
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy", "PodMonitor"):
        for d in by_kind.get(kind, []):
            if kind == "Service":
                selector = {"matchLabels": d["spec"].get("selector", {})}
            elif kind == "NetworkPolicy":
                selector = d["spec"]["podSelector"]
            else:
                selector = d["spec"]["selector"]
            if not any(matches(selector, labels) for labels in all_pod_labels):
                problem(name, f"{kind} {d['metadata']['name']} selects no pod")
    for pm in by_kind.get("PodMonitor", []):
        for endpoint in pm["spec"]["podMetricsEndpoints"]:
            for workload, template in templates:
                if matches(pm["spec"]["selector"], template["metadata"].get("labels", {})):
                    names = {p.get("name") for c in template["spec"]["containers"] for p in c.get("ports", [])}
                    if endpoint.get("port") not in names:
                        problem(name, f"PodMonitor {pm['metadata']['name']}: {workload['metadata']['name']} "
                                      f"has no port named {endpoint.get('port')}")

    # Network policies: metrics only from the monitoring namespace; gRPC of the router from
    # anywhere; the ConfigMap's UCX port range open between dxs pods.
    ucx_range = config.get("UCX_TCP_PORT_RANGE", "")
    ucx_ports = [int(p) for p in ucx_range.split("-")] if "-" in ucx_range else []
    ucx_open = False
    router_open = False
    for np in by_kind.get("NetworkPolicy", []):
        for rule in np["spec"].get("ingress", []):
            peers = rule.get("from")
            for rp in rule.get("ports", [{}]):
                if port_covered(rp, metrics_port):
                    only_monitoring = peers and all(
                        set(p) == {"namespaceSelector"} and
                        p["namespaceSelector"].get("matchLabels") ==
                        {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}
                        for p in peers)
                    if not only_monitoring:
                        problem(name, f"NetworkPolicy {np['metadata']['name']} opens the metrics port "
                                      f"{metrics_port} to more than the {MONITORING_NAMESPACE} namespace")
                if ucx_ports and peers and port_covered(rp, ucx_ports[0]) and \
                        port_covered(rp, ucx_ports[1]):
                    ucx_open = True
                if not peers and port_covered(rp, grpc_port) and \
                        np["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") == "router":
                    router_open = True
                elif not peers:
                    problem(name, f"NetworkPolicy {np['metadata']['name']} opens {rp} to everyone")
    if ucx_ports and not ucx_open:
        problem(name, f"no NetworkPolicy opens the UCX port range {ucx_range} between dxs pods")
    if not router_open:
        problem(name, "no NetworkPolicy opens the router's gRPC port to clients")

    # The dashboard ConfigMap for Grafana's sidecar.
    dashboards = [c for c in by_kind.get("ConfigMap", [])
                  if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    if len(dashboards) != 1:
        problem(name, f"expected one ConfigMap labelled grafana_dashboard=1, found {len(dashboards)}")
    elif dashboards[0]["data"].get("dxs-dashboard.json") != dashboard_text:
        problem(name, "the dashboard ConfigMap does not hold deploy/grafana/dxs-dashboard.json as is")


# ---------------------------------------------------------------- dashboard


def check_dashboard(path):
    where = os.path.relpath(path)
    try:
        dash = json.load(open(path))
    except (OSError, ValueError) as e:
        problem(where, f"does not parse: {e}")
        return []
    variables = {v["name"] for v in dash.get("templating", {}).get("list", [])}
    for needed in ("namespace", "model"):
        if needed not in variables:
            problem(where, f"no ${needed} variable")
    exprs = []
    panels = list(dash.get("panels", []))
    for p in panels:
        panels += p.get("panels", [])  # panels inside collapsed rows
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)):
        problem(where, "panel ids are not unique")
    for p in panels:
        if p.get("type") == "row":
            continue
        pw = f"{where}: panel {p.get('id')} '{p.get('title')}'"
        targets = p.get("targets") or []
        if not targets:
            problem(pw, "no targets")
        for t in targets:
            expr = t.get("expr", "")
            if not expr.strip():
                problem(pw, f"target {t.get('refId')} has no expression")
                continue
            if "$__" in expr:
                problem(pw, f"uses a Grafana macro: {expr}")
            for m in re.finditer(r"\b(dxs_[a-z0-9_]+)(\{[^}]*\})?", expr):
                metric, selector = m.group(1), m.group(2) or ""
                if metric not in KNOWN_SERIES:
                    problem(pw, f"unknown metric {metric}")
                if 'namespace=~"$namespace"' not in selector or 'model=~"$model"' not in selector:
                    problem(pw, f"{metric} lacks the namespace/model matchers: {expr}")
            exprs.append((f"panel_{p.get('id')}_{t.get('refId')}", expr))
    return exprs


def check_promql(exprs):
    promtool = shutil.which("promtool")
    if not promtool:
        print("validate: promtool not found (Debian: apt-get install prometheus); "
              "PromQL syntax not checked")
        return
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dxs_dashboard_check:{target}",
         "expr": expr.replace("$namespace", ".*").replace("$model", ".*")}
        for target, expr in exprs]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(rules, f)
    try:
        out = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        problem("dashboard PromQL", (out.stdout + out.stderr).strip())
    else:
        print(f"validate: promtool parsed all {len(exprs)} dashboard queries")


def check_metrics_doc(doc_path, exprs):
    """Warns (only) about dashboard metrics the catalog in docs/metrics.md does not list yet."""
    if not os.path.exists(doc_path):
        return
    text = open(doc_path).read()
    used = {m for _, e in exprs for m in re.findall(r"\b(dxs_[a-z0-9_]+)", e)}
    bases = {re.sub(r"_(bucket|sum|count)$", "", m) if re.sub(r"_(bucket|sum|count)$", "", m) in HISTOGRAMS
             else m for m in used}
    missing = sorted(m for m in bases if f"`{m}`" not in text)
    if missing:
        print(f"validate: note: docs/metrics.md does not list yet: {', '.join(missing)}")


# ---------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubernetes-version", required=True)
    parser.add_argument("--crds", required=True)
    parser.add_argument("--dashboard", required=True)
    parser.add_argument("--metrics-doc")
    parser.add_argument("rendered", nargs="+")
    args = parser.parse_args()

    crds = load_crds(args.crds)
    if not crds:
        problem(args.crds, "no CustomResourceDefinitions found")
    exprs = check_dashboard(args.dashboard)
    check_promql(exprs)
    if args.metrics_doc:
        check_metrics_doc(args.metrics_doc, exprs)
    dashboard_text = open(args.dashboard).read()

    for path in args.rendered:
        name = os.path.basename(path)
        docs = [d for d in yaml.safe_load_all(open(path)) if d]
        kinds = {}
        for d in docs:
            where = f"{name}: {d.get('kind')} {d.get('metadata', {}).get('name')}"
            validate_schema(d, where, args.kubernetes_version, crds)
            kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
        check_invariants(docs, name, dashboard_text)
        print(f"validate: {name}: {len(docs)} objects ("
              + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")")

    for p in problems:
        print(f"PROBLEM {p}")
    if problems:
        print(f"validate: {len(problems)} problem(s)")
        return 1
    print(f"validate: OK (Kubernetes {args.kubernetes_version} schemas, strict; "
          f"CRDs from {args.crds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
