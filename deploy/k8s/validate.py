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
    ConfigMap; ports and gRPC probes agree with DXS_GRPC_PORT / DXS_METRICS_PORT; the SMG
    gateway (where the output has one) runs `smg launch` with a --worker-urls naming the
    router's client Service and gRPC port, listens where its ports and HTTP probes say,
    serves metrics on DXS_METRICS_PORT, and its HTTP port is open to clients;
    Services, PodDisruptionBudgets, NetworkPolicies and the PodMonitor select pods that
    exist; the metrics port is reachable only from the monitoring namespace, the UCX port
    range of the ConfigMap is open between dxs pods; with DXS_DEVICE=cuda every image is a
    CUDA image (tag ending in -cuda); the dashboard ConfigMap carries the Grafana sidecar
    label and the dashboard file's exact content.
And the dashboard: it parses, every panel has targets with an expression, every metric
selector applies the $namespace and $model variables, no Grafana macros, only known metric
names (dxs's, and the SMG gateway's as smg exposes them), and (with promtool) every
expression parses as PromQL once the variables are substituted. Prints one line per
problem and exits 1 if there was any.
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
    "dxs_eplb_experts_moved_total", "dxs_eplb_recoveries_total", "dxs_ep_slowest_rounds_total",
}
HISTOGRAMS = {
    "dxs_dispatch_latency_seconds", "dxs_combine_latency_seconds", "dxs_step_duration_seconds",
    "dxs_time_to_first_token_seconds", "dxs_inter_token_latency_seconds",
    "dxs_request_duration_seconds", "dxs_ep_balance_ratio", "dxs_eplb_recovery_duration_seconds",
    "dxs_ep_answer_seconds",
}
# The SMG gateway's metrics, as smg 1.13.0 (SMG_VERSION in scripts/setup.sh) exposes them on
# --prometheus-port: recorded from its /metrics in front of a stub SGLang scheduler, after
# chat (streaming and not), completions and failing requests. Several appear only once a
# worker is registered (smg_worker_*, smg_engine_*) or a request was served (smg_router_*).
SMG_COUNTERS_AND_GAUGES = {
    "smg_admission_inflight", "smg_allocator_active_bytes", "smg_allocator_allocated_bytes",
    "smg_allocator_metadata_bytes", "smg_allocator_resident_bytes",
    "smg_detokenize_prefix_mismatch_total", "smg_engine_cache_hit_rate",
    "smg_engine_gen_throughput", "smg_engine_load_polls_total", "smg_engine_running_requests",
    "smg_engine_token_usage", "smg_engine_waiting_requests", "smg_history_memory_records",
    "smg_http_connections_active", "smg_http_rate_limit_total", "smg_http_requests_total",
    "smg_http_responses_total", "smg_mm_turbojpeg_available", "smg_mm_webp_available",
    "smg_router_request_body_path_total", "smg_router_request_buffers_released_early_bytes_total",
    "smg_router_request_errors_total", "smg_router_requests_total", "smg_router_tokens_total",
    "smg_tokenizer_cache_evictions_total", "smg_tokenizer_cache_lookups_total",
    "smg_tokenizer_cache_reused_bytes_total", "smg_tokenizer_encode_fallbacks_total",
    "smg_tokenizer_encode_path_loads_total", "smg_tokio_alive_tasks",
    "smg_tokio_global_queue_depth", "smg_tokio_worker_busy_ratio", "smg_tokio_worker_parks_total",
    "smg_tokio_workers", "smg_worker_cb_consecutive_failures",
    "smg_worker_cb_consecutive_successes", "smg_worker_cb_health_readmissions_total",
    "smg_worker_cb_outcomes_total", "smg_worker_cb_state", "smg_worker_cb_transitions_total",
    "smg_worker_health", "smg_worker_health_checks_total", "smg_worker_http2",
    "smg_worker_liveness_fallback_total", "smg_worker_overload_fallback_total",
    "smg_worker_overload_shed_total", "smg_worker_pool_size", "smg_worker_requests_active",
    "smg_worker_requests_total", "smg_worker_retries_exhausted_total", "smg_worker_retries_total",
    "smg_worker_selection_total",
}
SMG_HISTOGRAMS = {
    "smg_http_request_duration_seconds", "smg_router_generation_duration_seconds",
    "smg_router_request_duration_seconds", "smg_router_tpot_seconds", "smg_router_ttft_seconds",
    "smg_tokio_event_loop_delay_seconds", "smg_worker_retry_backoff_seconds",
}
KNOWN_SERIES = (COUNTERS_AND_GAUGES | SMG_COUNTERS_AND_GAUGES |
                {h + s for h in HISTOGRAMS | SMG_HISTOGRAMS for s in ("_bucket", "_sum", "_count")})
# smg launch's --policy choices (smg 1.13.0).
SMG_POLICIES = {"random", "round_robin", "passthrough", "cache_aware", "power_of_two", "least_load",
                "manual", "consistent_hashing", "prefix_hash"}
# smg's HTTP health routes: /liveness answers once it serves; /readiness only with a healthy
# worker whose tokenizer is loaded.
SMG_PROBE_PATHS = {"startupProbe": "/liveness", "livenessProbe": "/liveness",
                   "readinessProbe": "/readiness"}
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

    # Every dxs container: ports and probes agree with the ConfigMap, envFrom resolves; the
    # gateway's are checked on their own (check_gateway).
    configmap_names = {c["metadata"]["name"] for c in by_kind.get("ConfigMap", [])}
    gateway_ports = []
    for workload, template in templates:
        where = f"{name}: {workload['kind']} {workload['metadata']['name']}"
        spec = template["spec"]
        is_gateway = template["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "gateway"
        for c in spec.get("containers", []):
            if is_gateway:
                gateway_ports += check_gateway(where, c, docs, grpc_port, metrics_port)
                continue
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
    gateway_open = set()
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
                component = np["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component")
                if not peers and port_covered(rp, grpc_port) and component == "router":
                    router_open = True
                elif not peers and component == "gateway" and \
                        any(port_covered(rp, p) for p in gateway_ports) and \
                        not port_covered(rp, metrics_port):
                    gateway_open |= {p for p in gateway_ports if port_covered(rp, p)}
                elif not peers:
                    problem(name, f"NetworkPolicy {np['metadata']['name']} opens {rp} to everyone")
    if ucx_ports and not ucx_open:
        problem(name, f"no NetworkPolicy opens the UCX port range {ucx_range} between dxs pods")
    if not router_open:
        problem(name, "no NetworkPolicy opens the router's gRPC port to clients")
    for p in sorted(set(gateway_ports) - gateway_open):
        problem(name, f"no NetworkPolicy opens the gateway's HTTP port {p} to clients")

    # The dashboard ConfigMap for Grafana's sidecar.
    dashboards = [c for c in by_kind.get("ConfigMap", [])
                  if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    if len(dashboards) != 1:
        problem(name, f"expected one ConfigMap labelled grafana_dashboard=1, found {len(dashboards)}")
    elif dashboards[0]["data"].get("dxs-dashboard.json") != dashboard_text:
        problem(name, "the dashboard ConfigMap does not hold deploy/grafana/dxs-dashboard.json as is")


def smg_flags(args):
    """smg launch's arguments as {flag: [values]} (--flag value..., --flag=value)."""
    flags, current = {}, None
    for a in args:
        if a.startswith("--"):
            current, _, value = a.partition("=")
            flags.setdefault(current, [])
            if value:
                flags[current].append(value)
        elif current is not None:
            flags[current].append(a)
    return flags


def check_gateway(where, c, docs, grpc_port, metrics_port):
    """The SMG gateway container; returns its HTTP port(s), for the NetworkPolicy check."""
    where = f"{where}: container {c['name']}"
    cmd = list(c.get("command") or []) + list(c.get("args") or [])
    if cmd[:2] != ["smg", "launch"]:
        problem(where, f"runs {cmd[:2]}, not smg launch")
        return []
    flags = smg_flags(cmd[2:])

    def one(flag):
        values = flags.get(flag, [])
        if len(values) != 1:
            problem(where, f"smg launch needs exactly one {flag} (has {values})")
            return None
        return values[0]

    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    http = ports.get("http")
    if http is None:
        problem(where, f"no container port named http (ports {ports})")
    elif one("--port") != str(http):
        problem(where, f"--port {' '.join(flags.get('--port', []))} is not the http containerPort {http}")
    if ports.get("metrics") != metrics_port:
        problem(where, f"metrics containerPort {ports.get('metrics')} != DXS_METRICS_PORT {metrics_port}")
    if one("--prometheus-port") != str(metrics_port):
        problem(where, f"--prometheus-port {' '.join(flags.get('--prometheus-port', []))} != "
                           f"DXS_METRICS_PORT {metrics_port}")
    for flag in ("--host", "--prometheus-host"):
        if one(flag) not in ("0.0.0.0", "::"):
            problem(where, f"{flag} {' '.join(flags.get(flag, []))}: kubelet and Prometheus reach the "
                           "pod IP, not loopback")
    policy = one("--policy")
    if policy is not None and policy not in SMG_POLICIES:
        problem(where, f"--policy {policy} is not one of smg's: {sorted(SMG_POLICIES)}")

    # The worker: the router's client Service (Ready routers only: not the headless
    # dxs-router-cp, which lists the router before it is Ready) on the router's gRPC port.
    services = {s["metadata"]["name"]: s for s in docs if s["kind"] == "Service"}
    router_labels = [t["metadata"].get("labels", {}) for _, t in pod_templates(docs)
                     if t["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router"]
    urls = flags.get("--worker-urls", [])
    if not urls:
        problem(where, "smg launch has no --worker-urls")
    for url in urls:
        m = re.fullmatch(r"grpc://([a-z0-9-]+)(?:\.[a-z0-9.-]+)?:(\d+)", url)
        if not m:
            problem(where, f"--worker-urls {url}: not grpc://SERVICE:PORT")
            continue
        svc = services.get(m.group(1))
        if not svc:
            problem(where, f"--worker-urls {url}: no Service {m.group(1)} in the output")
            continue
        if svc["spec"].get("clusterIP") == "None" or svc["spec"].get("publishNotReadyAddresses"):
            problem(where, f"--worker-urls {url}: Service {m.group(1)} lists routers that are not Ready")
        if not any(matches({"matchLabels": svc["spec"].get("selector", {})}, labels) for labels in router_labels):
            problem(where, f"--worker-urls {url}: Service {m.group(1)} does not select the router")
        svc_ports = [p for p in svc["spec"].get("ports", []) if p.get("port") == int(m.group(2))]
        if int(m.group(2)) != grpc_port or not svc_ports:
            problem(where, f"--worker-urls {url}: not the router's gRPC port {grpc_port} on {m.group(1)}")

    for probe_name, path in SMG_PROBE_PATHS.items():
        probe = c.get(probe_name)
        get = (probe or {}).get("httpGet")
        if not get:
            problem(where, f"{probe_name}: want an httpGet probe on {path}")
            continue
        if get.get("path") != path:
            problem(where, f"{probe_name} on {get.get('path')}, not smg's {path}")
        if get.get("port") not in ("http", http):
            problem(where, f"{probe_name} on port {get.get('port')}, not the http port")

    # A Service for clients on the HTTP port.
    labels = None
    for d in docs:
        if d["kind"] == "Deployment" and any(x is c for x in d["spec"]["template"]["spec"].get("containers", [])):
            labels = d["spec"]["template"]["metadata"].get("labels", {})
    if labels is not None and not any(
            matches({"matchLabels": s["spec"].get("selector", {})}, labels) and
            any(p.get("targetPort") in ("http", http) for p in s["spec"].get("ports", []))
            for s in services.values()):
        problem(where, "no Service exposes the gateway's http port")
    return [http] if http is not None else []


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
            for m in re.finditer(r"\b((?:dxs|smg)_[a-z0-9_]+)(\{[^}]*\})?", expr):
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
