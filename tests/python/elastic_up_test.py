#!/usr/bin/env python3
"""`dxs up --elastic-ep`: a local cluster whose expert ranks may die and drain.

The cluster (router, 1 attention and 2 expert workers, every expert replicated on both
expert ranks) is started with `dxs up --elastic-ep --num-redundant-experts 16`. Checks:
`dxs status` reports elastic EP; a SIGKILLed expert worker is started again by `dxs up` and
rejoins as the same rank (a new incarnation, READY), and generation gives the tokens of
the single-process `dxs run` before, while and after; `dxs drain --rank 1` moves rank 1's
experts off and the worker exits, and `dxs up` leaves it gone; after SIGTERM no process is
left behind.

Run by ctest with the project's virtualenv (scripts/setup.sh creates it):
    .venv/bin/python3 tests/python/elastic_up_test.py --bin-dir build/bin
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from frontend_e2e_test import free_port, pids_mentioning

ARGS = None
PROMPT = [9, 41, 7, 300, 12]
# `dxs up` starts a failed expert worker again after this delay.
RESTART_DELAY_S = 1


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read()
    except OSError:
        return b""


class ElasticUp(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dxs_elastic_up_")
        cls.dxs = os.path.join(ARGS.bin_dir, "dxs")
        cls.model = os.path.join(cls.tmp, "model")
        subprocess.run([cls.dxs, "gen-model", "--out", cls.model], check=True,
                       stdout=subprocess.DEVNULL)
        cls.router = "127.0.0.1:%d" % free_port()
        cls.log_path = os.path.join(cls.tmp, "up.log")
        cls.log = open(cls.log_path, "w+")
        cls.up = subprocess.Popen(
            [cls.dxs, "up", "--model", cls.model, "--attention", "1", "--experts", "2",
             "--elastic-ep", "--num-redundant-experts", "16",
             "--port", cls.router.split(":")[1], "--log-dir", os.path.join(cls.tmp, "logs")],
            stdout=cls.log, stderr=subprocess.STDOUT)
        cls.wait_for_log("listening on", 120)
        cls.want = json.loads(subprocess.run(
            [cls.dxs, "run", "--model", cls.model, "--prompt-ids", ",".join(map(str, PROMPT)),
             "--max-new-tokens", "8", "--format", "json"],
            check=True, capture_output=True, text=True).stdout)["tokens"]

    @classmethod
    def tearDownClass(cls):
        if cls.up.poll() is None:
            cls.up.kill()
            cls.up.wait()
        cls.log.close()

    @classmethod
    def wait_for_log(cls, text, seconds):
        deadline = time.time() + seconds
        while time.time() < deadline:
            cls.log.seek(0)
            if text in cls.log.read():
                return
            assert cls.up.poll() is None, "dxs up exited early"
            time.sleep(0.1)
        cls.log.seek(0)
        raise AssertionError("no '%s' from dxs up within %d s:\n%s" % (text, seconds, cls.log.read()))

    def status(self):
        return json.loads(subprocess.run(
            [self.dxs, "status", "--router", self.router, "--format", "json"],
            check=True, capture_output=True, text=True).stdout)

    def expert_pids(self, rank):
        return [p for p in pids_mentioning(self.tmp)
                if b"dxs-expert\0" in cmdline(p) and b"\0--rank\0%d\0" % rank in cmdline(p)]

    def expert(self, status, rank):
        live = [w for w in status["workers"] if w["role"] == "expert" and w["rank"] == rank
                and w["state"] != "DEAD"]
        return live[0] if live else None

    def generate(self):
        out = subprocess.run(
            [self.dxs, "generate", "--router", self.router, "--prompt-ids",
             ",".join(map(str, PROMPT)), "--max-new-tokens", "8", "--format", "json"],
            capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        return json.loads(out.stdout)["tokens"]

    def test_1_a_killed_expert_worker_is_started_again_and_rejoins(self):
        before = self.status()
        self.assertTrue(before["elastic_ep"], before)
        old = self.expert(before, 1)
        self.assertIsNotNone(old, before)
        self.assertEqual(self.generate(), self.want)
        pids = self.expert_pids(1)
        self.assertEqual(len(pids), 1, pids)
        os.kill(pids[0], signal.SIGKILL)
        # Served throughout: rank 0 holds a replica of every expert.
        self.assertEqual(self.generate(), self.want)
        self.wait_for_log("expert1 exited (signal 9); starting it again", 30)
        deadline = time.time() + 60
        while time.time() < deadline:
            now = self.expert(self.status(), 1)
            if now and now["incarnation"] != old["incarnation"] and now["state"] == "READY":
                break
            time.sleep(0.2)
        else:
            self.fail("expert rank 1 did not rejoin: %s" % json.dumps(self.status()))
        self.assertEqual(self.generate(), self.want)

    def test_2_a_drained_expert_rank_leaves_and_stays_gone(self):
        out = subprocess.run([self.dxs, "drain", "--router", self.router, "--rank", "1"],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.wait_for_log("expert1 exited (exit status 0): drained, not restarted", 60)
        # Every start of the worker writes to its log (appended on a restart).
        worker_log = os.path.join(self.tmp, "logs", "expert1.log")
        log_size = os.path.getsize(worker_log)
        status = self.status()
        self.assertIsNone(self.expert(status, 1), status)
        held = {p["rank"]: p["experts"] for p in status["placement"]}
        self.assertEqual(held.get(1, []), [], status)
        self.assertEqual(sorted(held[0]), list(range(16)), status)
        self.assertEqual(self.generate(), self.want)
        # Nothing starts it again: no process and no new output in its log for three times
        # the restart delay, which a restart would have produced well within.
        deadline = time.time() + 3 * RESTART_DELAY_S
        while time.time() < deadline:
            self.assertEqual(self.expert_pids(1), [], "the drained worker was started again")
            self.assertEqual(os.path.getsize(worker_log), log_size,
                             "the drained worker was started again: " + worker_log)
            time.sleep(0.1)
        self.assertIsNone(self.expert(self.status(), 1))

    def test_3_sigterm_leaves_no_process(self):
        self.up.send_signal(signal.SIGTERM)
        self.up.wait(timeout=30)
        deadline = time.time() + 30
        while pids_mentioning(self.tmp) and time.time() < deadline:
            time.sleep(0.1)
        self.assertEqual(pids_mentioning(self.tmp), [])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--source-dir", default="")
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
