"""Simulated hosts for multi-host tests: one network and one IPC namespace per host.

A `Hosts(n)` is n hosts on one private /24, each a network namespace `dxs-<pid>-h<i>` with
a veth `eth0` whose peer `h<i>` is a port of a bridge `br0` in one more namespace,
`dxs-<pid>-br`. Every link and address lives inside namespaces the harness creates, so
nothing in the root namespace changes and two runs never see each other's traffic; deleting
the namespaces removes every link. Processes run on a host through
`ip netns exec <ns> unshare --ipc <cmd>`: their own IPC namespace too, so System V shared
memory made on one host cannot be attached from another (what a second machine is).

Faults, all undone by the harness:
- `partition(i)` / `heal(i)`: the bridge's port to host i goes down and back up, so frames
  to and from host i are dropped in between (host i's own link loses its carrier, as when a
  switch port dies); nothing is closed or reset: both sides learn of it only by waiting.
- `limit_rate(i, rate)` / `unlimit_rate(i)`: a tbf qdisc on both ends of host i's link
  (tbf, htb and pfifo are in this kernel; netem is not).
- `freeze(proc)` / `thaw(proc)`: SIGSTOP / SIGCONT.

The names carry the creating process's pid. Start-up deletes namespaces `dxs-<pid>-...`
whose pid is not alive (a crashed run's), and ours if any are left over from a run that had
our pid; namespaces of a live run are left alone.

Where the machine cannot make namespaces (not root, no `ip`, no `unshare`, or the kernel
refuses), `Hosts.setup()` raises `HostsUnavailable` with the reason; tests print it and exit
with `SKIP_CODE`, ctest's SKIP_RETURN_CODE for these tests (tests/python/CMakeLists.txt).
"""
import os
import re
import shutil
import signal
import subprocess
import time

# ctest reports a test that exits with this code as skipped (SKIP_RETURN_CODE).
SKIP_CODE = 77
NS_PREFIX = "dxs-"
_NS_RE = re.compile(r"^dxs-(\d+)-(h\d+|br)$")


class HostsUnavailable(Exception):
    """This machine cannot build simulated hosts; the message says why."""


def _run(argv, check=True, timeout=30):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError("%s failed (exit %d): %s" % (" ".join(argv), out.returncode,
                                                        (out.stderr or out.stdout).strip()))
    return out


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces():
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def remove_stale_namespaces(own_pid=None):
    """Deletes dxs-<pid>-... namespaces whose pid is dead (or is own_pid); returns them."""
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == own_pid or not _pid_alive(pid):
            _kill_processes_in(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    return removed


def _kill_processes_in(ns):
    out = _run(["ip", "netns", "pids", ns], check=False)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def check_capable():
    """Raises HostsUnavailable naming what this machine lacks to simulate hosts."""
    if os.geteuid() != 0:
        raise HostsUnavailable("simulated hosts need root (network namespaces); running as uid %d"
                               % os.geteuid())
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            raise HostsUnavailable("no `%s` on PATH (Debian package %s; scripts/setup.sh installs it)"
                                   % (tool, package))


class Proc:
    """A process started on a simulated host; `popen.pid` is the command itself (ip netns
    exec and unshare both exec, so signals reach it)."""

    def __init__(self, host, name, popen, log_path):
        self.host, self.name, self.popen, self.log_path = host, name, popen, log_path

    @property
    def pid(self):
        return self.popen.pid

    def alive(self):
        return self.popen.poll() is None

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self, timeout=10):
        if self.popen.poll() is not None:
            return self.popen.returncode
        try:
            os.kill(self.pid, signal.SIGCONT)  # a frozen process cannot act on SIGTERM
            self.popen.terminate()
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait(timeout=timeout)


class Host:
    def __init__(self, hosts, index):
        self.hosts, self.index = hosts, index
        self.ns = "%s%s-h%d" % (NS_PREFIX, hosts.run_id, index)
        self.ip = "%s.%d" % (hosts.subnet, index + 1)
        self.port = "h%d" % index  # the bridge's port to this host, in the bridge namespace

    def argv(self, cmd, ipc=True):
        """cmd run on this host: its network namespace, and its own IPC namespace."""
        return ["ip", "netns", "exec", self.ns] + (["unshare", "--ipc"] if ipc else []) + list(cmd)

    def start(self, name, cmd, env=None):
        log_path = os.path.join(self.hosts.log_dir, "%s.log" % name)
        log = open(log_path, "ab")
        full_env = dict(os.environ)
        full_env.update(env or {})
        popen = subprocess.Popen(self.argv(cmd), stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=full_env)
        log.close()
        proc = Proc(self, name, popen, log_path)
        self.hosts.procs.append(proc)
        return proc

    def run(self, cmd, timeout=60, check=True, ipc=True):
        """Runs cmd on this host to completion; returns the CompletedProcess."""
        out = subprocess.run(self.argv(cmd, ipc), capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError("on %s: %s failed (exit %d): %s" % (
                self.ns, " ".join(cmd), out.returncode, out.stderr.strip()))
        return out


class Hosts:
    """n simulated hosts on subnet.0/24 (host i at subnet.(i+1)); a context manager."""

    def __init__(self, n, log_dir, subnet="10.43.0"):
        self.n, self.log_dir, self.subnet = n, log_dir, subnet
        self.run_id = str(os.getpid())
        self.bridge_ns = "%s%s-br" % (NS_PREFIX, self.run_id)
        self.hosts = [Host(self, i) for i in range(n)]
        self.procs = []
        self.created = []

    def __getitem__(self, i):
        return self.hosts[i]

    def __enter__(self):
        self.setup()
        return self

    def __exit__(self, *exc):
        self.teardown()

    def setup(self):
        check_capable()
        os.makedirs(self.log_dir, exist_ok=True)
        remove_stale_namespaces(own_pid=os.getpid())
        try:
            self._ns_add(self.bridge_ns)
        except RuntimeError as e:
            raise HostsUnavailable("cannot create a network namespace: %s" % e)
        try:
            # unshare --ipc is what every process start does; probe it once here.
            out = _run(["ip", "netns", "exec", self.bridge_ns, "unshare", "--ipc", "true"],
                       check=False)
            if out.returncode != 0:
                raise HostsUnavailable("`unshare --ipc` fails in a network namespace: %s"
                                       % out.stderr.strip())
            br = self.bridge_ns
            _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", br, "link", "set", "br0", "up"])
            for h in self.hosts:
                self._ns_add(h.ns)
                _run(["ip", "link", "add", "eth0", "netns", h.ns, "type", "veth", "peer", "name",
                      h.port, "netns", br])
                _run(["ip", "-n", br, "link", "set", h.port, "master", "br0", "up"])
                _run(["ip", "-n", h.ns, "addr", "add", "%s/24" % h.ip, "dev", "eth0"])
                _run(["ip", "-n", h.ns, "link", "set", "eth0", "up"])
                _run(["ip", "-n", h.ns, "link", "set", "lo", "up"])
        except Exception:
            self.teardown()
            raise

    def _ns_add(self, ns):
        _run(["ip", "netns", "add", ns])
        self.created.append(ns)

    def teardown(self):
        for p in reversed(self.procs):
            try:
                p.stop(timeout=10)
            except Exception:
                pass
        for ns in reversed(self.created):
            _kill_processes_in(ns)
            _run(["ip", "netns", "del", ns], check=False)
        self.created = []

    def sockets(self):
        """Every host's TCP sockets with their queues (`ss -tnpi`): where bytes wait, in a
        sender's kernel (Send-Q) or a receiver's (Recv-Q), when a failed test is looked at."""
        out = []
        for h in self.hosts:
            r = _run(["ip", "netns", "exec", h.ns, "ss", "-tnpi"], check=False)
            out.append("---- sockets of %s (%s) ----\n%s" % (h.ns, h.ip, r.stdout.strip()))
        return "\n".join(out)

    # Faults.
    def partition(self, i):
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.hosts[i].port, "down"])

    def heal(self, i):
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.hosts[i].port, "up"])

    def limit_rate(self, i, rate="10mbit", burst="32kb", latency="50ms"):
        """Caps host i's link at rate in both directions (tbf on each end of its veth)."""
        h = self.hosts[i]
        for ns, dev in ((h.ns, "eth0"), (self.bridge_ns, h.port)):
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                  "burst", burst, "latency", latency])

    def unlimit_rate(self, i):
        h = self.hosts[i]
        for ns, dev in ((h.ns, "eth0"), (self.bridge_ns, h.port)):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    @staticmethod
    def freeze(proc):
        os.kill(proc.pid, signal.SIGSTOP)

    @staticmethod
    def thaw(proc):
        os.kill(proc.pid, signal.SIGCONT)


def wait_for(condition, seconds, what, interval=0.05):
    """Polls condition() until it returns a true value (returned) or seconds pass (fails,
    naming what did not happen)."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError("%s did not happen within %g s" % (what, seconds))
        time.sleep(interval)


def probe(log_dir):
    """Raises HostsUnavailable unless a simulated host can be made here (one is made and
    removed again)."""
    hosts = Hosts(1, log_dir)
    hosts.setup()
    hosts.teardown()
