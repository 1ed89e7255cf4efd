"""A dxs cluster spread over simulated hosts (hosts_lib), and what the hosts tests share.

Layout (one process per host, as pods on separate machines): host 0 the router, then the
attention workers, then the expert workers, and last a client host from which the test
sends requests (hosts_client.py) and scrapes metrics: the test itself stays in the root
namespace, which has no link to the hosts. Every process listens on its host's address,
and workers register that address with the router, so everything between them crosses the
bridge: gRPC (control and requests) and UCX (the data path; TCP, since no host can map
another's shared memory).
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import hosts_lib

ROUTER_PORT = 50051
METRICS_PORT = 9400
HERE = os.path.dirname(os.path.abspath(__file__))


def skip_if_unavailable(fn):
    """Runs fn(); where the machine cannot simulate hosts, prints why and exits SKIP_CODE."""
    try:
        return fn()
    except hosts_lib.HostsUnavailable as e:
        print("SKIPPED: %s" % e, flush=True)
        sys.exit(hosts_lib.SKIP_CODE)


def gen_stubs(source_dir, out_dir):
    """dxs.v1's Python stubs into out_dir (grpcio-tools' protoc)."""
    from grpc_tools import protoc
    proto_root = os.path.join(source_dir, "proto")
    protos = sorted(glob.glob(os.path.join(proto_root, "dxs", "v1", "*.proto")))
    rc = protoc.main(["protoc", "-I" + proto_root, "--python_out=" + out_dir,
                      "--grpc_python_out=" + out_dir] + protos)
    assert rc == 0, "protoc failed"


class Cluster:
    def __init__(self, bin_dir, source_dir, attention=2, experts=3, router_args=(),
                 attention_args=(), expert_args=(), prefix="dxs_hosts_"):
        self.bin_dir, self.source_dir = bin_dir, source_dir
        self.m, self.n = attention, experts
        self.router_args, self.attention_args = list(router_args), list(attention_args)
        self.expert_args = list(expert_args)
        self.tmp = tempfile.mkdtemp(prefix=prefix)
        self.dxs = os.path.join(bin_dir, "dxs")
        self.python = sys.executable
        self.hosts = hosts_lib.Hosts(2 + attention + experts, os.path.join(self.tmp, "logs"))
        self.router_host = self.hosts[0]
        self.attention_hosts = [self.hosts[1 + r] for r in range(attention)]
        self.expert_hosts = [self.hosts[1 + attention + r] for r in range(experts)]
        self.client_host = self.hosts[1 + attention + experts]
        self.router = "%s:%d" % (self.router_host.ip, ROUTER_PORT)
        self.procs = {}

    # Set-up.
    def setup_hosts(self):
        self.hosts.setup()

    def start(self, model, timeout=120):
        self.model = model
        self.gen_dir = os.path.join(self.tmp, "gen")
        os.makedirs(self.gen_dir, exist_ok=True)
        gen_stubs(self.source_dir, self.gen_dir)
        b = self.bin_dir
        self.start_router()
        for r, h in enumerate(self.expert_hosts):
            self.start_expert(r)
        for r, h in enumerate(self.attention_hosts):
            self.procs["attention%d" % r] = h.start("attention%d" % r, [
                b + "/dxs-attention", "--model", model, "--rank", str(r), "--router",
                self.router, "--listen", "%s:0" % h.ip, "--metrics-listen",
                "%s:%d" % (h.ip, METRICS_PORT)] + self.attention_args)
        self.wait_ready(timeout)

    def start_router(self):
        b = self.bin_dir
        self.procs["router"] = self.router_host.start("router", [
            b + "/dxs-router", "--listen", self.router, "--metrics-listen",
            "%s:%d" % (self.router_host.ip, METRICS_PORT), "--model", self.model,
            "--attention", str(self.m), "--experts", str(self.n)] + self.router_args)
        return self.procs["router"]

    def start_expert(self, r):
        h = self.expert_hosts[r]
        self.procs["expert%d" % r] = h.start("expert%d" % r, [
            self.bin_dir + "/dxs-expert", "--model", self.model, "--rank", str(r), "--router",
            self.router, "--listen", "%s:0" % h.ip, "--metrics-listen",
            "%s:%d" % (h.ip, METRICS_PORT)] + self.expert_args)
        return self.procs["expert%d" % r]

    def teardown(self):
        self.hosts.teardown()

    def logs(self):
        return "\n".join("---- %s (%s) ----\n%s" % (name, p.host.ns, p.log()[-4000:])
                         for name, p in self.procs.items())

    # Observing.
    def status(self):
        """`dxs status` from the client host, or None when the router does not answer."""
        out = self.client_host.run([self.dxs, "status", "--router", self.router, "--format",
                                    "json"], check=False, timeout=30)
        if out.returncode != 0:
            return None
        return json.loads(out.stdout)

    def all_ready(self):
        s = self.status()
        if not s:
            return False
        live = [w for w in s["workers"] if w["state"] == "READY"]
        return len(live) == self.m + self.n and s

    def wait_ready(self, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if not p.alive():
                    raise AssertionError("%s exited (%s) before the cluster was ready:\n%s"
                                         % (name, p.popen.returncode, self.logs()))
            if self.all_ready():
                return
            time.sleep(0.2)
        raise AssertionError("the cluster was not ready within %d s: %s\n%s"
                             % (seconds, json.dumps(self.status()), self.logs()))

    def scrape(self, host):
        out = self.client_host.run([self.python, os.path.join(HERE, "hosts_client.py"), "scrape",
                                    "--url", "http://%s:%d/metrics" % (host.ip, METRICS_PORT)],
                                   check=False, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout

    # Requests.
    def start_client(self, spec, timeout=120, keepalive_ms=0):
        """Starts hosts_client.py generate on the client host; returns a ClientRun."""
        path = os.path.join(self.tmp, "spec-%d.json" % time.monotonic_ns())
        with open(path, "w") as f:
            json.dump(spec, f)
        argv = self.client_host.argv([self.python, "-u", os.path.join(HERE, "hosts_client.py"),
                                      "generate", "--router", self.router, "--gen-dir",
                                      self.gen_dir, "--spec", path, "--timeout", str(timeout),
                                      "--keepalive-ms", str(keepalive_ms)])
        return ClientRun(argv, len(spec))

    def start_load(self, streams, timeout=60, keepalive_ms=0):
        """Starts hosts_client.py load on the client host: each of `streams` (a list of
        request lists) sends its requests one after another until LoadRun.stop()."""
        stamp = time.monotonic_ns()
        path = os.path.join(self.tmp, "load-%d.json" % stamp)
        with open(path, "w") as f:
            json.dump(streams, f)
        stop = os.path.join(self.tmp, "load-%d.stop" % stamp)
        argv = self.client_host.argv([self.python, "-u", os.path.join(HERE, "hosts_client.py"),
                                      "load", "--router", self.router, "--gen-dir",
                                      self.gen_dir, "--spec", path, "--stop", stop,
                                      "--timeout", str(timeout), "--keepalive-ms",
                                      str(keepalive_ms)])
        return LoadRun(argv, stop, streams)

    def worker(self, role, rank, status=None):
        """The worker entry of (role, rank) in `dxs status` (or status), or None."""
        s = status or self.status()
        if not s:
            return None
        for w in s["workers"]:
            if w["role"] == role and w["rank"] == rank:
                return w
        return None

    def experts_of(self, rank, status):
        """The experts EP rank `rank` holds in status's placement."""
        for p in status.get("placement", []):
            if p["rank"] == rank:
                return p["experts"]
        return []

    def generate_all(self, spec, seconds=180, keepalive_ms=0):
        """Sends spec's requests at once and returns their end events, by index."""
        run = self.start_client(spec, timeout=seconds, keepalive_ms=keepalive_ms)
        run.wait_all(seconds + 30)
        return run.ends


class ClientRun:
    """hosts_client.py generate; a thread reads its events as it prints them."""

    def __init__(self, argv, count):
        self.count = count
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        self.lock = threading.Lock()
        self.events = []
        self.ends = {}
        self.first_token = {}  # request -> when its first token arrived
        self.tokens_so_far = {}  # request -> tokens streamed so far
        self.done = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.popen.stdout:
            if not line.strip():
                continue
            ev = json.loads(line)
            with self.lock:
                self.events.append(ev)
                if ev["ev"] == "tokens" and ev["n"] > 0:
                    self.first_token.setdefault(ev["i"], ev["t"])
                    self.tokens_so_far[ev["i"]] = ev["n"]
                elif ev["ev"] == "end":
                    self.ends[ev["i"]] = ev
                elif ev["ev"] == "all_done":
                    self.done = True

    def snapshot(self):
        with self.lock:
            return dict(self.first_token), dict(self.ends), self.done

    def snapshot_tokens(self):
        with self.lock:
            return dict(self.tokens_so_far)

    def wait_all(self, seconds):
        hosts_lib.wait_for(lambda: self.snapshot()[2] or self.popen.poll() is not None, seconds,
                           "every request's end (%d of %d ended)" % (len(self.ends), self.count))
        self.popen.wait(timeout=30)
        self.reader.join(timeout=30)
        err = self.popen.stderr.read()
        self.popen.stdout.close()
        self.popen.stderr.close()
        assert self.done and len(self.ends) == self.count, (
            "the client ended without every request's end: %d of %d; stderr:\n%s"
            % (len(self.ends), self.count, err))

    def kill(self):
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


class LoadRun:
    """hosts_client.py load; a thread reads the requests' ends as they come."""

    def __init__(self, argv, stop_path, streams):
        self.stop_path, self.streams = stop_path, streams
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        self.lock = threading.Lock()
        self.ends = []
        self.done = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.popen.stdout:
            if not line.strip():
                continue
            ev = json.loads(line)
            with self.lock:
                if ev["ev"] == "end":
                    self.ends.append(ev)
                elif ev["ev"] == "all_done":
                    self.done = True

    def snapshot(self):
        with self.lock:
            return list(self.ends)

    def ok_after(self, t):
        """Requests sent at or after t that ended OK."""
        return [e for e in self.snapshot() if e["t0"] >= t and e["code"] == "OK"]

    def stop(self, seconds=120):
        """Asks every stream to end after its current request and waits for them; returns
        the ends."""
        with open(self.stop_path, "w") as f:
            f.write("stop\n")
        try:
            hosts_lib.wait_for(lambda: self.done or self.popen.poll() is not None, seconds,
                               "the load's streams to end")
            self.popen.wait(timeout=30)
            self.reader.join(timeout=30)
        finally:
            self.kill()
        err = self.popen.stderr.read()
        self.popen.stdout.close()
        self.popen.stderr.close()
        assert self.done, "the load client ended without all_done; stderr:\n%s" % err
        return self.snapshot()

    def kill(self):
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def check_load_ends(ends, streams, want):
    """Every stream's requests ended once each, numbered 0..K-1 without a gap (none lost,
    none answered twice); returns (ok, failed) lists; want[s][j] is the single-process
    tokens of stream s's request j, which every OK end must equal."""
    by_stream = {}
    for e in ends:
        by_stream.setdefault(e["s"], []).append(e["k"])
    for s in range(len(streams)):
        ks = sorted(by_stream.get(s, []))
        assert ks == list(range(len(ks))), "stream %d's request ends: %s" % (s, ks)
    ok = [e for e in ends if e["code"] == "OK"]
    for e in ok:
        assert e["tokens"] == want[e["s"]][e["j"]], (
            "stream %d request %d: %s, the single-process engine %s"
            % (e["s"], e["k"], e["tokens"], want[e["s"]][e["j"]]))
    return ok, [e for e in ends if e["code"] != "OK"]


def reference_tokens(dxs, model, prompt, max_new_tokens, ignore_eos=False):
    """The single-process engine's greedy tokens (`dxs run`)."""
    argv = [dxs, "run", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", str(max_new_tokens), "--format", "json"]
    if ignore_eos:
        argv.append("--ignore-eos")
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["tokens"]


def metric(text, name, labels):
    """The sum of name's samples whose labels include every labels item."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all('%s="%s"' % kv in head for kv in labels.items()):
            total += float(value)
            found = True
    return total if found else None


class ClusterTest(unittest.TestCase):
    """A test class whose tests share one cluster on simulated hosts: 2 attention and 3
    expert ranks (each on its own host) and a client host, over a model `dxs gen-model`
    writes. Subclasses set PREFIX (the temp dir's) and ROUTER_ARGS; ARGS comes from
    main()."""
    ARGS = None
    PREFIX = "dxs_hosts_"
    ROUTER_ARGS = ()

    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster(cls.ARGS.bin_dir, cls.ARGS.source_dir, attention=2, experts=3,
                              router_args=list(cls.ROUTER_ARGS), prefix=cls.PREFIX)
        c = cls.cluster
        cls.model = os.path.join(c.tmp, "model")
        hosts_lib._run([c.dxs, "gen-model", "--out", cls.model], timeout=120)
        try:
            c.setup_hosts()
            c.start(cls.model, timeout=120)
        except Exception:
            c.teardown()
            raise

    failed = False

    def run(self, result=None):
        # Notes whether this test failed, so tearDownClass keeps the logs of a failed run.
        result = result or self.defaultTestResult()
        before = len(result.failures) + len(result.errors)
        out = super().run(result)
        if len(result.failures) + len(result.errors) > before:
            type(self).failed = True
        return out

    @classmethod
    def tearDownClass(cls):
        c = cls.cluster
        if cls.failed:
            # Every process's log, then kept on disk beside the model for a closer look.
            print("\n%s\n%s\n%s: logs kept in %s" % (c.logs(), c.hosts.sockets(), cls.__name__,
                                                    c.tmp), flush=True)
        c.teardown()
        if not cls.failed:
            shutil.rmtree(c.tmp, ignore_errors=True)


def main():
    """A hosts test's entry point: --bin-dir (and --source-dir), skipped (77) where the
    machine cannot make namespaces, then unittest."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--source-dir", default=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))))
    args, rest = ap.parse_known_args()
    ClusterTest.ARGS = args
    probe_dir = tempfile.mkdtemp(prefix="dxs_hosts_probe_")
    try:
        skip_if_unavailable(lambda: hosts_lib.probe(probe_dir))
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    unittest.main(module="__main__", argv=[sys.argv[0]] + rest, verbosity=2)
