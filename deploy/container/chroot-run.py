#!/usr/bin/env python3
"""Runs a command in an image's root file system with chroot, as a container would run it.

`podman run` cannot start containers on machines whose cgroups crun refuses, so
scripts/check-container.sh builds the image with `podman build --isolation chroot`, exports
its file system (`podman export`) and runs the image's binaries here: in a chroot with
/proc, /sys and /dev mounted and /etc/resolv.conf and /etc/hosts written as a container
runtime provides them, as the image's USER, in its WORKDIR, with its ENV (all three read
from `podman image inspect`), plus --env overrides. Processes share the host's network
(loopback), which the check wants.

  chroot-run.py --root DIR --image-config INSPECT.json [--user U] [--env K=V ...]
                [--bind HOST:GUEST ...] -- CMD...

INSPECT.json is `podman image inspect IMAGE` (a list of one object) or its first object.
Needs root (chroot, mount).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ChrootError(Exception):
    pass


class Mounts:
    """/proc, /sys, /dev, resolv.conf and extra read-only binds inside a root."""

    def __init__(self, root, binds=()):
        self.root, self.binds, self.done = root, list(binds), []

    def _mount(self, args, target, source=None):
        if source is not None and os.path.isfile(source):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.exists(target):
                open(target, "w").close()
        else:
            os.makedirs(target, exist_ok=True)
        subprocess.run(["mount"] + args + [target], check=True)
        self.done.append(target)

    def __enter__(self):
        r = self.root
        self._mount(["-t", "proc", "proc"], f"{r}/proc")
        for d in ("sys", "dev"):
            self._mount(["--rbind", f"/{d}"], f"{r}/{d}")
            subprocess.run(["mount", "--make-rslave", f"{r}/{d}"], check=True)
        for host, guest in self.binds:
            target = r + guest
            self._mount(["--bind", host], target, source=host)
            subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)
        # What a container runtime writes into every container: the host's resolver, and
        # an /etc/hosts with localhost and the (here: shared) host name.
        os.makedirs(f"{r}/etc", exist_ok=True)
        resolv = f"{r}/etc/resolv.conf"
        if os.path.islink(resolv):
            os.unlink(resolv)
        shutil.copyfile("/etc/resolv.conf", resolv)
        with open(f"{r}/etc/hosts", "w") as f:
            f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                    f"127.0.1.1\t{os.uname().nodename}\n")
        return self

    def __exit__(self, *exc):
        for target in reversed(self.done):
            subprocess.run(["umount", "-R", target], check=False)
        self.done = []


def resolve_user(root, user):
    """USER name[:group] or uid[:gid] -> (uid, gid, home)."""
    name, _, group = user.partition(":")
    uid = gid = None
    home = "/"
    passwd = f"{root}/etc/passwd"
    entries = [l.rstrip("\n").split(":") for l in open(passwd)] if os.path.exists(passwd) else []
    for e in entries:
        if e[0] == name or e[2] == name:
            uid, gid, home = int(e[2]), int(e[3]), e[5]
            break
    if uid is None:
        if not name.isdigit():
            raise ChrootError(f"USER {user}: no such user in the image")
        uid, gid = int(name), int(name)
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            for l in open(f"{root}/etc/group"):
                e = l.split(":")
                if e[0] == group:
                    gid = int(e[2])
                    break
            else:
                raise ChrootError(f"USER {user}: no such group in the image")
    return uid, gid, home


def run_in_root(root, argv, user, workdir, env, check=True):
    uid, gid, home = resolve_user(root, user)
    env = dict(env)
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("HOME", home)

    def enter():
        os.chroot(root)
        os.chdir("/")
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        os.chdir(workdir)

    return subprocess.run(argv, env=env, preexec_fn=enter, check=check)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="the image's exported file system")
    parser.add_argument("--image-config", required=True, help="podman image inspect output")
    parser.add_argument("--user", help="instead of the image's USER")
    parser.add_argument("--env", action="append", default=[], help="K=V on top of the image's ENV")
    parser.add_argument("--bind", action="append", default=[], help="HOST:GUEST read-only bind")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("chroot-run: needs root (chroot, mount)")
    inspect = json.load(open(args.image_config))
    config = (inspect[0] if isinstance(inspect, list) else inspect).get("Config", {})
    env = dict(kv.split("=", 1) for kv in config.get("Env") or [])
    env.update(dict(kv.split("=", 1) for kv in args.env))
    user = args.user or config.get("User") or "0"
    workdir = config.get("WorkingDir") or "/"
    root = os.path.abspath(args.root)
    binds = [tuple(b.split(":", 1)) for b in args.bind]
    try:
        with Mounts(root, binds):
            return run_in_root(root, args.command, user, workdir, env, check=False).returncode
    except ChrootError as e:
        print(f"chroot-run: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
