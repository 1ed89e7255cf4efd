#!/usr/bin/env python3
"""Replays a Dockerfile in chroots, for machines without a container engine.

scripts/check-container.sh uses it to run deploy/container/Dockerfile for real: every stage
starts as a copy of a debootstrapped Debian root (standing in for the FROM image), and its
instructions run in order: ARG, ENV, WORKDIR, USER, COPY (from the context, filtered by the
Dockerfile's .dockerignore, or --from an earlier stage, with --chown/--chmod) and RUN (shell
or exec form, in a chroot with /proc, /sys and /dev mounted, and /etc/resolv.conf and
/etc/hosts written as a container runtime provides them, as the current USER, in the
current WORKDIR, with the stage's ARGs and ENVs in the environment). CMD, ENTRYPOINT, EXPOSE and LABEL are recorded. RUN --mount options are
accepted and ignored (a cache mount only speeds up a rebuild). Anything else is refused,
so a Dockerfile change that this replay cannot honour fails loudly instead of being
skipped.

  chroot-build.py build --dockerfile F --context DIR --base ROOTFS --image debian:bookworm \
                        --work DIR [--env K=V ...] [--bind HOST:GUEST[:STAGE] ...]
      Builds every stage into WORK/stages/NAME and writes WORK/stages/NAME.json (user,
      workdir, env, cmd) for each.
  chroot-build.py run --stage WORK/stages/NAME [--user U] [--env K=V ...] -- CMD...
      Runs CMD in that stage's root with its recorded user, workdir and environment.

Needs root (chroot, mount).
"""

import argparse
import fnmatch
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class DockerfileError(Exception):
    pass


# ---------------------------------------------------------------- parsing


def parse_dockerfile(text):
    """Returns [(line_number, INSTRUCTION, rest)] with continuations joined."""
    out = []
    pending, start = None, 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and pending is None):
            continue  # comments (also inside continuations) and blank lines
        if pending is None:
            pending, start = "", number
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        pending += stripped
        word, _, rest = pending.partition(" ")
        out.append((start, word.upper(), rest.strip()))
        pending = None
    if pending is not None:
        raise DockerfileError(f"line {start}: continuation runs past the end of the file")
    return out


def substitute(value, variables):
    """${VAR}, ${VAR:-default}, ${VAR:+alt} and $VAR, as Docker expands them."""

    def repl(m):
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        val = variables.get(name)
        if op == ":-":
            return val if val else substitute(arg, variables)
        if op == ":+":
            return substitute(arg, variables) if val else ""
        return val or ""

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)",
                  repl, value)


def split_options(rest):
    """Splits leading --name=value options off an instruction's arguments."""
    options = {}
    words = rest.split(" ")
    while words and words[0].startswith("--"):
        name, _, value = words.pop(0)[2:].partition("=")
        options.setdefault(name, []).append(value)
    return options, " ".join(w for w in words if w != "")


def parse_key_values(rest, variables, instruction):
    """ENV/ARG/LABEL arguments: k=v pairs (values may be quoted), or the legacy 'k v'."""
    words = shlex.split(rest)
    if words and "=" not in words[0]:
        if instruction == "ARG":
            return [(words[0], None)]
        return [(words[0], substitute(" ".join(words[1:]), variables))]
    pairs = []
    for w in words:
        k, eq, v = w.partition("=")
        pairs.append((k, substitute(v, variables) if eq else None))
    return pairs


# ---------------------------------------------------------------- .dockerignore


def load_ignore(dockerfile, context):
    for candidate in (dockerfile + ".dockerignore", os.path.join(context, ".dockerignore")):
        if os.path.exists(candidate):
            patterns = []
            for line in open(candidate):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith("!"):
                    raise DockerfileError(f"{candidate}: '!' exceptions are not supported here")
                patterns.append(line.strip("/"))
            return patterns
    return []


def ignored(rel, patterns):
    for p in patterns:
        if fnmatch.fnmatchcase(rel, p):
            return True
        if p.startswith("**/") and fnmatch.fnmatchcase(os.path.basename(rel), p[3:]):
            return True
    return False


# ---------------------------------------------------------------- building


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
            raise DockerfileError(f"USER {user}: no such user in the image")
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
                raise DockerfileError(f"USER {user}: no such group in the image")
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


def copy_into(sources, dest, root, chown=None, chmod=None):
    """Docker COPY semantics for the cases used: files, directory contents, globs."""
    dest_is_dir = dest.endswith("/") or len(sources) > 1
    for src, patterns, base in sources:
        if os.path.isdir(src):
            target = root + dest
            for dirpath, dirnames, filenames in os.walk(src):
                rel_dir = os.path.relpath(dirpath, src)
                keep = []
                for d in dirnames:
                    rel = os.path.normpath(os.path.join(os.path.relpath(dirpath, base), d))
                    if not ignored(rel, patterns):
                        keep.append(d)
                dirnames[:] = keep
                os.makedirs(os.path.normpath(os.path.join(target, rel_dir)), exist_ok=True)
                for f in filenames:
                    rel = os.path.normpath(os.path.join(os.path.relpath(dirpath, base), f))
                    if ignored(rel, patterns):
                        continue
                    out = os.path.normpath(os.path.join(target, rel_dir, f))
                    if os.path.lexists(out):
                        os.unlink(out)
                    shutil.copy2(os.path.join(dirpath, f), out, follow_symlinks=False)
        else:
            target = root + (os.path.join(dest, os.path.basename(src)) if dest_is_dir else dest)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(src, target)
    if chown or chmod:
        uid, gid, _ = resolve_user(root, chown) if chown else (None, None, None)
        top = root + dest
        for dirpath, _, filenames in os.walk(top) if os.path.isdir(top) else [(None, [], [top])]:
            paths = ([dirpath] if dirpath else []) + [
                os.path.join(dirpath, f) if dirpath else f for f in filenames]
            for p in paths:
                if chown:
                    os.lchown(p, uid, gid)
                if chmod and not os.path.islink(p):
                    os.chmod(p, int(chmod, 8))


def build(args):
    dockerfile = os.path.abspath(args.dockerfile)
    context = os.path.abspath(args.context)
    patterns = load_ignore(dockerfile, context)
    instructions = parse_dockerfile(open(dockerfile).read())
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    binds = []  # (host, guest, only this stage or None)
    for b in args.bind:
        host, guest, only = (b.split(":") + [None])[:3]
        binds.append((host, guest, only))
    stages_dir = os.path.join(args.work, "stages")
    os.makedirs(stages_dir, exist_ok=True)

    global_args = {}
    stages = {}  # name -> root
    stage = None
    mounts = None

    def finish_stage():
        nonlocal mounts
        if mounts:
            mounts.__exit__(None, None, None)
            mounts = None
        if stage:
            with open(stage["root"] + ".json", "w") as f:
                json.dump({k: stage[k] for k in ("user", "workdir", "env", "cmd", "entrypoint",
                                                 "expose")}, f, indent=2)

    try:
        for number, inst, rest in instructions:
            where = f"{args.dockerfile}:{number} {inst}"
            if inst == "ARG" and stage is None:
                for k, v in parse_key_values(rest, global_args, "ARG"):
                    global_args[k] = extra_env.get(k, v or "")
                continue
            if inst == "FROM":
                finish_stage()
                words = rest.split()
                image = substitute(words[0], global_args)
                name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
                if image != args.image:
                    raise DockerfileError(f"{where}: image {image}, but the base root is {args.image}")
                root = os.path.join(stages_dir, name)
                if os.path.exists(root):
                    # A run killed half-way may have left its mounts behind.
                    for d in ["proc", "sys", "dev"] + [g for _, g, _ in binds]:
                        subprocess.run(["umount", "-R", root + "/" + d.lstrip("/")],
                                       stderr=subprocess.DEVNULL, check=False)
                    subprocess.run(["rm", "-rf", "--one-file-system", root], check=True)
                print(f"chroot-build: stage {name}: copying {args.base} (as {image})", flush=True)
                subprocess.run(["cp", "-a", args.base, root], check=True)
                stage = {"root": root, "user": "0", "workdir": "/", "env": {}, "args": {},
                         "cmd": None, "entrypoint": None, "expose": []}
                stages[name] = root
                mounts = Mounts(root, [(h, g) for h, g, only in binds
                                       if only in (None, name)]).__enter__()
                continue
            if stage is None:
                raise DockerfileError(f"{where}: before the first FROM")
            variables = {**stage["args"], **stage["env"]}
            print(f"chroot-build: {where} {rest}", flush=True)
            if inst == "ARG":
                for k, v in parse_key_values(rest, variables, "ARG"):
                    if k in extra_env:
                        v = extra_env[k]
                    elif v is None:
                        v = global_args.get(k, "")
                    stage["args"][k] = v
            elif inst == "ENV":
                for k, v in parse_key_values(rest, variables, "ENV"):
                    stage["env"][k] = v or ""
            elif inst == "USER":
                stage["user"] = substitute(rest, variables)
                resolve_user(stage["root"], stage["user"])
            elif inst == "WORKDIR":
                wd = os.path.join(stage["workdir"], substitute(rest, variables))
                os.makedirs(stage["root"] + wd, exist_ok=True)
                stage["workdir"] = wd
            elif inst == "COPY":
                options, rest = split_options(rest)
                words = [substitute(w, variables) for w in shlex.split(rest)]
                srcs, dest = words[:-1], words[-1]
                if not dest.startswith("/"):
                    dest = os.path.join(stage["workdir"], dest) + ("/" if dest.endswith("/") else "")
                sources = []
                if "from" in options:
                    frm = options["from"][0]
                    if frm not in stages:
                        raise DockerfileError(f"{where}: no earlier stage {frm}")
                    for s in srcs:
                        sources += [(p, [], stages[frm]) for p in glob.glob(stages[frm] + s)]
                else:
                    for s in srcs:
                        matched = glob.glob(os.path.join(context, s))
                        sources += [(os.path.normpath(p), patterns, context) for p in matched]
                if not sources:
                    raise DockerfileError(f"{where}: nothing matches {srcs}")
                copy_into(sources, dest, stage["root"], (options.get("chown") or [None])[0],
                          (options.get("chmod") or [None])[0])
            elif inst == "RUN":
                options, rest = split_options(rest)
                unknown = set(options) - {"mount", "network"}
                if unknown:
                    raise DockerfileError(f"{where}: unsupported options {sorted(unknown)}")
                argv = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
                env = {**stage["args"], **stage["env"], **extra_env}
                result = run_in_root(stage["root"], argv, stage["user"], stage["workdir"], env,
                                     check=False)
                if result.returncode != 0:
                    raise DockerfileError(f"{where}: exit status {result.returncode}")
            elif inst in ("CMD", "ENTRYPOINT"):
                stage[inst.lower()] = json.loads(rest) if rest.startswith("[") else [
                    "/bin/sh", "-c", rest]
            elif inst == "EXPOSE":
                stage["expose"] += substitute(rest, variables).split()
            elif inst == "LABEL":
                pass
            else:
                raise DockerfileError(f"{where}: instruction not supported by this replay")
        finish_stage()
    finally:
        if mounts:
            mounts.__exit__(None, None, None)
    print(f"chroot-build: built stages {', '.join(stages)} under {stages_dir}")


def run(args):
    root = os.path.abspath(args.stage)
    config = json.load(open(root + ".json"))
    env = {**config["env"], **dict(kv.split("=", 1) for kv in args.env)}
    user = args.user or config["user"]
    binds = [tuple(b.split(":", 1)) for b in args.bind]
    with Mounts(root, binds):
        result = run_in_root(root, args.command, user, config["workdir"], env, check=False)
    return result.returncode


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build")
    b.add_argument("--dockerfile", required=True)
    b.add_argument("--context", required=True)
    b.add_argument("--base", required=True, help="root file system standing in for the FROM image")
    b.add_argument("--image", required=True, help="the image name FROM must resolve to")
    b.add_argument("--work", required=True)
    b.add_argument("--env", action="append", default=[], help="K=V for RUN steps and ARG overrides")
    b.add_argument("--bind", action="append", default=[],
                   help="HOST:GUEST[:STAGE] read-only bind during RUN steps (of STAGE only)")
    r = sub.add_parser("run")
    r.add_argument("--stage", required=True)
    r.add_argument("--user")
    r.add_argument("--env", action="append", default=[])
    r.add_argument("--bind", action="append", default=[])
    r.add_argument("command", nargs="+")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("chroot-build: needs root (chroot, mount)")
    try:
        if args.what == "build":
            build(args)
            return 0
        return run(args)
    except DockerfileError as e:
        print(f"chroot-build: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
