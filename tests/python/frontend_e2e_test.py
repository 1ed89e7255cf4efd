#!/usr/bin/env python3
"""A Python frontend against a real local cluster, as a user's gateway would call it.

Stubs are generated from proto/dxs/v1 at test time with grpcio-tools. The cluster is
started with `dxs up` (router, 2 attention and 2 expert workers on loopback). Checks:
Generate streams the same greedy tokens as the single-process `dxs run`; GetModelInfo
describes the model; `dxs status` then shows every rank READY; a bad request gets
INVALID_ARGUMENT naming the field; `dxs bench --request-rate` (open loop) answers every
request at each rate; and after
SIGTERM, `dxs up` leaves no process behind.

Run by ctest with the project's virtualenv (scripts/setup.sh creates it):
    .venv/bin/python3 tests/python/frontend_e2e_test.py --bin-dir build/bin
"""
import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

ARGS = None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids_mentioning(text):
    """Processes whose command line contains `text` (our temp dir is unique)."""
    out = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                if text.encode() in f.read():
                    out.append(int(cmdline.split("/")[2]))
        except OSError:
            pass
    return out


class FrontendEndToEnd(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dxs_py_")
        gen = os.path.join(cls.tmp, "gen")
        os.makedirs(gen)
        proto_root = os.path.join(ARGS.source_dir, "proto")
        protos = sorted(glob.glob(os.path.join(proto_root, "dxs", "v1", "*.proto")))
        from grpc_tools import protoc
        rc = protoc.main(["protoc", "-I" + proto_root, "--python_out=" + gen,
                          "--grpc_python_out=" + gen] + protos)
        assert rc == 0, "protoc failed"
        sys.path.insert(0, gen)
        global grpc, frontend_pb2, frontend_pb2_grpc
        import grpc
        from dxs.v1 import frontend_pb2, frontend_pb2_grpc

        cls.dxs = os.path.join(ARGS.bin_dir, "dxs")
        cls.model = os.path.join(cls.tmp, "model")
        subprocess.run([cls.dxs, "gen-model", "--out", cls.model], check=True,
                       stdout=subprocess.DEVNULL)
        cls.port = free_port()
        cls.log = open(os.path.join(cls.tmp, "up.log"), "w+")
        cls.up = subprocess.Popen(
            [cls.dxs, "up", "--model", cls.model, "--attention", "2", "--experts", "2",
             "--port", str(cls.port), "--log-dir", os.path.join(cls.tmp, "logs")],
            stdout=cls.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            cls.log.seek(0)
            if "listening on" in cls.log.read():
                break
            assert cls.up.poll() is None, "dxs up exited early"
            time.sleep(0.1)
        else:
            raise AssertionError("dxs up did not become healthy")
        cls.channel = grpc.insecure_channel("127.0.0.1:%d" % cls.port)
        cls.stub = frontend_pb2_grpc.FrontendStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        if cls.up.poll() is None:
            cls.up.kill()
            cls.up.wait()

    def test_1_generate_streams_the_single_process_tokens(self):
        prompt = [9, 41, 7, 300, 12]
        want = json.loads(subprocess.run(
            [self.dxs, "run", "--model", self.model, "--prompt-ids",
             ",".join(map(str, prompt)), "--max-new-tokens", "12", "--format", "json"],
            check=True, capture_output=True, text=True).stdout)["tokens"]
        req = frontend_pb2.GenerateRequest(prompt_token_ids=prompt)
        req.sampling_params.max_new_tokens = 12
        req.sampling_params.temperature = 0.0
        tokens, complete, indices = [], None, []
        for msg in self.stub.Generate(req, timeout=60):
            if msg.HasField("chunk"):
                indices.append(msg.chunk.index)
                tokens.extend(msg.chunk.token_ids)
            elif msg.HasField("complete"):
                complete = msg.complete
        self.assertEqual(tokens, want)
        self.assertEqual(indices, sorted(indices))
        self.assertIsNotNone(complete)
        self.assertEqual(complete.completion_tokens, 12)
        self.assertEqual(complete.prompt_tokens, len(prompt))
        self.assertEqual(complete.finish_reason, frontend_pb2.FINISH_REASON_LENGTH)

        # The router served it, so its view (what `dxs status` shows) has every rank
        # READY, as its health said: a fresh `dxs up` once listed them all JOINING here.
        status = json.loads(subprocess.run(
            [self.dxs, "status", "--router", "127.0.0.1:%d" % self.port, "--format", "json"],
            check=True, capture_output=True, text=True).stdout)
        self.assertEqual(len(status["workers"]), 4)
        for w in status["workers"]:
            self.assertEqual(w["state"], "READY", status)

    def test_2_model_info_and_bad_input(self):
        info = self.stub.GetModelInfo(frontend_pb2.GetModelInfoRequest(), timeout=10).model_info
        self.assertEqual(info.vocab_size, 4096)
        self.assertEqual(info.num_experts, 16)
        self.assertEqual(info.num_experts_per_token, 4)
        req = frontend_pb2.GenerateRequest(prompt_token_ids=[1, 99999])
        req.sampling_params.max_new_tokens = 4
        with self.assertRaises(grpc.RpcError) as err:
            list(self.stub.Generate(req, timeout=10))
        self.assertEqual(err.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("prompt", err.exception.details())

    def test_2b_open_loop_bench(self):
        """`dxs bench --request-rate`: one JSON line per rate, every request answered, the
        same seeded lengths at every rate (log-normal: not all the median), another seed
        other lengths, goodput never above the request rate, bad flags refused; and the
        same workload on the single-process engine (--local)."""
        def bench(*flags):
            out = subprocess.run(
                [self.dxs, "bench", "--router", "127.0.0.1:%d" % self.port, "--requests",
                 "12", "--prompt-len", "8", "--output-len", "6", "--len-sigma", "0.6",
                 "--format", "json"] + list(flags),
                capture_output=True, text=True, timeout=300)
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            return [json.loads(line) for line in out.stdout.splitlines()]

        rates = bench("--request-rate", "40,inf", "--seed", "3")
        self.assertEqual([r["request_rate"] for r in rates], [40, "inf"])
        for r in rates:
            self.assertEqual(r["errors"], {}, r)
            self.assertEqual(r["requests"], 12)
            self.assertGreater(r["ttft_ms"]["p50"], 0)
            self.assertGreater(r["tpot_ms"]["p50"], 0)
            self.assertLessEqual(r["goodput_requests_per_second"],
                                 r["requests_per_second"] + 1e-9)
            self.assertEqual(r["slo"], {"ttft_ms": 1000, "tpot_ms": 50})
        self.assertEqual(rates[0]["prompt_tokens"], rates[1]["prompt_tokens"])
        self.assertEqual(rates[0]["output_tokens"], rates[1]["output_tokens"])
        self.assertNotEqual(rates[0]["prompt_tokens"], 12 * 8)
        other = bench("--request-rate", "inf", "--seed", "4")
        self.assertNotEqual(other[0]["prompt_tokens"], rates[0]["prompt_tokens"])
        for flags, says in ((["--request-rate", "0"], "--request-rate"),
                            (["--request-rate", "fast"], "--request-rate"),
                            (["--request-rate", "5", "--len-sigma", "9"], "--len-sigma")):
            out = subprocess.run(
                [self.dxs, "bench", "--router", "127.0.0.1:%d" % self.port] + flags,
                capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 2, flags)
            self.assertIn(says, out.stderr)
        # The single-process engine serving the same seeded arrivals (LocalServer): every
        # request answered, the same lengths, the same tokens out (greedy, ignore_eos).
        out = subprocess.run(
            [self.dxs, "bench", "--local", self.model, "--requests", "12", "--prompt-len", "8",
             "--output-len", "6", "--len-sigma", "0.6", "--format", "json", "--request-rate",
             "40,inf", "--seed", "3"], capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        local = [json.loads(line) for line in out.stdout.splitlines()]
        self.assertEqual([r["request_rate"] for r in local], [40, "inf"])
        for r, remote in zip(local, rates):
            self.assertEqual(r["errors"], {}, r)
            self.assertEqual(r["local"], self.model)
            self.assertEqual(r["prompt_tokens"], remote["prompt_tokens"])
            self.assertEqual(r["output_tokens"], remote["output_tokens"])
            self.assertGreater(r["ttft_ms"]["p50"], 0)

    def test_3_sigterm_leaves_no_process_behind(self):
        self.assertTrue(pids_mentioning(self.tmp), "the cluster should be running")
        self.up.send_signal(signal.SIGTERM)
        self.assertEqual(self.up.wait(timeout=30), 0)
        deadline = time.time() + 30
        while pids_mentioning(self.tmp) and time.time() < deadline:
            time.sleep(0.1)
        self.assertEqual(pids_mentioning(self.tmp), [], "orphan processes after SIGTERM")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--source-dir", default=os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))))
    ARGS, rest = ap.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
