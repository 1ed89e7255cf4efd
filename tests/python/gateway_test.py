#!/usr/bin/env python3
"""OpenAI clients against a dxs cluster through the real SMG gateway.

`dxs up --gateway-port` starts a cluster of 2 attention and 2 expert workers and the SMG
gateway (PyPI `smg`, pinned in scripts/setup.sh) in front of the router, which serves the
gateway protocol (sglang.grpc.scheduler.SglangScheduler). The `openai` client (pinned) calls
the gateway; Hugging Face `tokenizers` decodes with the model's tokenizer.json (written by
`dxs gen-model`). Checks:
- chat completions, streamed and not: the text is the tokenizer's decoding of the tokens
  `dxs generate` gives for the same prompt ids (greedy); usage counts are right;
- log-probabilities (chat: logprobs, top_logprobs) equal `dxs generate`'s; n=2; stop
  strings (one token and several); max_tokens (finish_reason length); seed repeatability on
  the gateway protocol itself (SMG does not forward OpenAI's seed);
- a client that disconnects mid-stream frees its request in dxs: KV back, in-flight gauge 0;
- 64 concurrent chat streams, each equal to its solo run;
- bad requests get OpenAI-style errors and the cluster serves on;
- one gateway in front of two clusters spreads requests by load and survives one stopping;
- the protocol's other RPCs, called directly: GetModelInfo, GetServerInfo, GetLoads,
  GetTokenizer (zip + sha256), refusals by name.

Run by ctest with the project's virtualenv (scripts/setup.sh creates it):
    .venv/bin/python3 tests/python/gateway_test.py --bin-dir build/bin --source-dir .
"""
import argparse
import concurrent.futures
import glob
import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request
import zipfile

ARGS = None
# Generous bounds for events the tests wait for (never fixed sleeps).
START_TIMEOUT_S = 240
EVENT_TIMEOUT_S = 120


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what, timeout=EVENT_TIMEOUT_S, interval=0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("timed out waiting for " + what)


def metric_sum(text, name, labels=None):
    """Sum of a Prometheus metric's samples (optionally those whose labels include `labels`)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        if labels and not all('%s="%s"' % kv in (m.group(2) or "") for kv in labels.items()):
            continue
        total += float(m.group(3))
        found = True
    return total if found else None


def stop_process(proc, timeout=30):
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def http_get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


class Cluster:
    """`dxs up` in a temp dir, optionally with the gateway."""

    def __init__(self, tmp, name, model, attention, experts, gateway=False):
        self.port = free_port()
        self.gateway_port = free_port() if gateway else None
        self.log_dir = os.path.join(tmp, name + "-logs")
        self.out = open(os.path.join(tmp, name + "-up.log"), "w+")
        argv = [os.path.join(ARGS.bin_dir, "dxs"), "up", "--model", model,
                "--attention", str(attention), "--experts", str(experts),
                "--port", str(self.port), "--log-dir", self.log_dir]
        self.gateway_metrics_port = free_port() if gateway else None
        if gateway:
            argv += ["--gateway-port", str(self.gateway_port),
                     "--gateway-metrics-port", str(self.gateway_metrics_port)]
        self.proc = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT)
        want = "gateway (OpenAI API) on" if gateway else "listening on"

        def up():
            assert self.proc.poll() is None, "dxs up exited early:\n" + self.log()
            return want in self.log()
        wait_for(up, "dxs up (%s)" % name, timeout=START_TIMEOUT_S)
        self.address = "127.0.0.1:%d" % self.port

    def log(self):
        self.out.seek(0)
        return self.out.read()

    def metrics_address(self, process):
        """The metrics HOST:PORT a process printed in its log ("... metrics on H:P")."""
        path = os.path.join(self.log_dir, process + ".log")
        def find():
            with open(path) as f:
                m = re.search(r"metrics on (\S+)", f.read())
            return m.group(1) if m else None
        return wait_for(find, "the metrics address of " + process)

    def stop(self):
        stop_process(self.proc, timeout=60)


class GatewayTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dxs_gateway_")
        gen = os.path.join(cls.tmp, "gen")
        os.makedirs(gen)
        proto_root = os.path.join(ARGS.source_dir, "proto")
        from grpc_tools import protoc
        rc = protoc.main(["protoc", "-I" + proto_root, "--python_out=" + gen,
                          "--grpc_python_out=" + gen] +
                         sorted(glob.glob(os.path.join(proto_root, "dxs", "v1", "*.proto"))))
        assert rc == 0, "protoc failed"
        sys.path.insert(0, gen)
        global grpc, frontend_pb2, frontend_pb2_grpc, sglang_pb2, sglang_pb2_grpc, common_pb2
        global openai, tokenizers
        import grpc
        import openai
        import tokenizers
        from dxs.v1 import frontend_pb2, frontend_pb2_grpc
        # The gateway protocol's Python stubs ship in the same pinned wheel.
        from smg_grpc_proto import sglang_scheduler_pb2 as sglang_pb2
        from smg_grpc_proto import sglang_scheduler_pb2_grpc as sglang_pb2_grpc
        from smg_grpc_proto.generated import common_pb2

        cls.dxs = os.path.join(ARGS.bin_dir, "dxs")
        # The served model's name is the directory's: "default", as for the embedded model.
        cls.model = os.path.join(cls.tmp, "default")
        subprocess.run([cls.dxs, "gen-model", "--out", cls.model], check=True,
                       stdout=subprocess.DEVNULL)
        cls.tokenizer = tokenizers.Tokenizer.from_file(os.path.join(cls.model, "tokenizer.json"))
        cls.cluster = Cluster(cls.tmp, "main", cls.model, 2, 2, gateway=True)
        cls.client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % cls.cluster.gateway_port,
                                   api_key="none", max_retries=0, timeout=EVENT_TIMEOUT_S)
        cls.channel = grpc.insecure_channel(cls.cluster.address)
        cls.frontend = frontend_pb2_grpc.FrontendStub(cls.channel)
        cls.scheduler = sglang_pb2_grpc.SglangSchedulerStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()
        cls.cluster.out.close()

    # --- helpers ---

    def chat_prompt_ids(self, content):
        """The chat template of `dxs gen-model` (Qwen3's shape), rendered by hand."""
        text = "<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n" % content
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def dxs_generate(self, prompt_ids, max_new_tokens, *extra):
        out = subprocess.run(
            [self.dxs, "generate", "--router", self.cluster.address, "--prompt-ids",
             ",".join(map(str, prompt_ids)), "--max-new-tokens", str(max_new_tokens),
             "--temperature", "0", "--format", "json"] + list(extra),
            check=True, capture_output=True, text=True).stdout
        return json.loads(out)

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat(self, content, **kwargs):
        kwargs.setdefault("max_tokens", 12)
        kwargs.setdefault("temperature", 0)
        return self.client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}], **kwargs)

    def stream_text(self, content, **kwargs):
        text, usage, finish = "", None, None
        for chunk in self.chat(content, stream=True, stream_options={"include_usage": True},
                               **kwargs):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, usage, finish

    # --- tests ---

    def test_01_chat_text_equals_dxs_generate(self):
        for content in ["Hello there", "What is a mixture of experts?"]:
            prompt = self.chat_prompt_ids(content)
            want = self.dxs_generate(prompt, 12)["tokens"]
            r = self.chat(content)
            self.assertEqual(r.choices[0].message.content, self.decode(want), content)
            self.assertEqual(r.usage.prompt_tokens, len(prompt))
            self.assertEqual(r.usage.completion_tokens, len(want))
            self.assertEqual(r.model, "default")
            text, usage, finish = self.stream_text(content)
            self.assertEqual(text, self.decode(want), content)
            self.assertEqual(usage.prompt_tokens, len(prompt))
            self.assertEqual(usage.completion_tokens, len(want))
            self.assertEqual(finish, r.choices[0].finish_reason)

    def test_02_logprobs_equal_dxs_generate(self):
        content = "Score these tokens"
        prompt = self.chat_prompt_ids(content)
        want = self.dxs_generate(prompt, 6, "--logprobs", "--top-logprobs", "3")
        r = self.chat(content, max_tokens=6, logprobs=True, top_logprobs=3)
        got = r.choices[0].logprobs.content
        self.assertEqual(len(got), 6)
        for i, position in enumerate(got):
            self.assertAlmostEqual(position.logprob, want["logprobs"][i], places=4)
            self.assertEqual(len(position.top_logprobs), 3)
            self.assertEqual(position.token, self.decode([want["tokens"][i]]))
            # dxs generate's top_logprobs: [[token id, logprob], ...] per position.
            for alt, (token, logprob) in zip(position.top_logprobs, want["top_logprobs"][i]):
                self.assertEqual(alt.token, self.decode([token]))
                self.assertAlmostEqual(alt.logprob, logprob, places=4)
            # Greedy picks the most likely token.
            self.assertAlmostEqual(position.top_logprobs[0].logprob, position.logprob, places=5)

    def test_03_n_samples(self):
        r = self.chat("Tell me two things", n=2, temperature=1.0, max_tokens=8)
        self.assertEqual(sorted(c.index for c in r.choices), [0, 1])
        for c in r.choices:
            self.assertEqual(c.finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 16)
        text, usage, _ = self.stream_text("Tell me two things", n=2, temperature=1.0,
                                          max_tokens=8)
        self.assertEqual(usage.completion_tokens, 16)

    def test_04_max_tokens_finishes_with_length(self):
        r = self.chat("Count", max_tokens=5, extra_body={"ignore_eos": True})
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 5)

    def test_05_stop_strings(self):
        content = "Stop somewhere please"
        prompt = self.chat_prompt_ids(content)
        tokens = self.dxs_generate(prompt, 16, "--ignore-eos")["tokens"]
        full = self.decode(tokens)
        # A stop string of several tokens (the gateway matches it in text) and one of a
        # single token (the gateway sends it as a stop token id): the text ends before it.
        pieces = [p for p in (self.decode(tokens[5:8]), self.decode([tokens[6]])) if p.strip()]
        self.assertTrue(pieces, "no printable stop string in %r" % full)
        for stop in pieces:
            r = self.chat(content, max_tokens=16, stop=[stop], extra_body={"ignore_eos": True})
            self.assertEqual(r.choices[0].finish_reason, "stop", stop)
            self.assertEqual(r.choices[0].message.content, full[:full.find(stop)], stop)
            text, _, finish = self.stream_text(content, max_tokens=16, stop=[stop],
                                               extra_body={"ignore_eos": True})
            self.assertEqual(text, full[:full.find(stop)], stop)
            self.assertEqual(finish, "stop")

    def test_06_seed_repeats_on_the_protocol(self):
        # SMG 1.13 does not forward OpenAI's seed (the protocol has no field); a direct
        # caller passes it in custom_params.
        def run(seed):
            req = sglang_pb2.GenerateRequest(request_id="seed-%d-%f" % (seed, time.time()),
                                             stream=False)
            req.tokenized.input_ids.extend([5, 6, 7, 8])
            req.sampling_params.temperature = 1.0
            req.sampling_params.top_p = 1.0
            req.sampling_params.top_k = -1
            req.sampling_params.max_new_tokens = 10
            req.sampling_params.custom_params.update({"seed": seed})
            completes = [m.complete for m in self.scheduler.Generate(req, timeout=60)
                         if m.HasField("complete")]
            self.assertEqual(len(completes), 1)
            return list(completes[0].output_ids)
        self.assertEqual(run(7), run(7))
        self.assertNotEqual(run(7), run(8))

    def test_07_disconnect_frees_the_request(self):
        router_metrics = "http://%s/metrics" % self.cluster.metrics_address("router")
        steps_before = sum(
            metric_sum(http_get("http://%s/metrics" % self.cluster.metrics_address(
                "attention%d" % r)), "dxs_steps_total") or 0 for r in range(2)) / 2
        max_tokens = 3000
        stream = self.chat("Talk for a long time", max_tokens=max_tokens, stream=True,
                           extra_body={"ignore_eos": True})
        received = 0
        for chunk in stream:
            received += sum(1 for c in chunk.choices if c.delta.content)
            if received >= 3:
                break
        stream.close()  # the client goes away mid-stream

        def freed():
            loads = self.frontend.GetLoads(frontend_pb2.GetLoadsRequest(), timeout=10).loads
            inflight = metric_sum(http_get(router_metrics), "dxs_inflight_requests")
            return (all(l.kv_cache_used_tokens == 0 and l.num_running_requests == 0
                        for l in loads) and inflight == 0)
        wait_for(freed, "the disconnected request's KV cache to be freed")
        # Stopped, not finished: the ranks took far fewer steps than its max_tokens.
        steps_after = sum(
            metric_sum(http_get("http://%s/metrics" % self.cluster.metrics_address(
                "attention%d" % r)), "dxs_steps_total") or 0 for r in range(2)) / 2
        self.assertLess(steps_after - steps_before, max_tokens / 2)
        for r in range(2):
            kv = metric_sum(http_get("http://%s/metrics" % self.cluster.metrics_address(
                "attention%d" % r)), "dxs_kv_cache_used_tokens")
            self.assertEqual(kv, 0)

    def test_08_concurrent_streams_equal_solo_runs(self):
        contents = ["Question number %d" % i for i in range(64)]
        solo = {c: self.stream_text(c, max_tokens=8)[0] for c in contents}
        with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
            together = dict(zip(contents, pool.map(
                lambda c: self.stream_text(c, max_tokens=8)[0], contents)))
        for c in contents:
            self.assertEqual(together[c], solo[c], c)

    def test_09_bad_requests_get_openai_errors(self):
        cases = [
            (dict(model="no-such-model"), 404),
            (dict(max_tokens=100000), 400),
            (dict(logprobs=True, top_logprobs=50), 400),
            (dict(temperature=-1.0), 400),
        ]
        for kwargs, status in cases:
            model = kwargs.pop("model", "default")
            with self.assertRaises(openai.APIStatusError) as err:
                self.client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}],
                    **dict(dict(max_tokens=4), **kwargs))
            self.assertEqual(err.exception.status_code, status, kwargs)
            # OpenAI's error object: {"error": {"message", "type", ...}} (the client unwraps it).
            self.assertIsInstance(err.exception.body, dict)
            self.assertTrue(err.exception.body.get("message"), err.exception.body)
            self.assertTrue(err.exception.body.get("type"), err.exception.body)
        # The cluster serves on.
        r = self.chat("Still there?", max_tokens=4)
        self.assertEqual(r.usage.completion_tokens, 4)

    def test_10_protocol_rpcs(self):
        info = self.scheduler.GetModelInfo(sglang_pb2.GetModelInfoRequest(), timeout=10)
        self.assertEqual(info.served_model_name, "default")
        self.assertEqual(info.vocab_size, 4096)
        self.assertEqual(list(info.eos_token_ids), [2])
        self.assertEqual(info.max_context_length, 4096)
        self.assertIn("Qwen3MoeForCausalLM", info.architectures)
        self.assertTrue(info.is_generation)
        server = self.scheduler.GetServerInfo(sglang_pb2.GetServerInfoRequest(), timeout=10)
        self.assertEqual(server.server_args["dp_size"], 2)
        self.assertEqual(server.server_type, "grpc")
        loads = self.scheduler.GetLoads(sglang_pb2.GetLoadsRequest(include=["all"]), timeout=10)
        self.assertEqual(loads.dp_rank_count, 2)
        self.assertEqual(sorted(l.dp_rank for l in loads.loads), [0, 1])
        for l in loads.loads:
            self.assertGreater(l.max_total_num_tokens, 0)
            self.assertEqual(l.memory.token_capacity, l.max_total_num_tokens)
        self.assertTrue(self.scheduler.HealthCheck(sglang_pb2.HealthCheckRequest(),
                                                   timeout=10).healthy)
        # gRPC health and reflection list the service beside dxs.v1.
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        health = health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service="sglang.grpc.scheduler.SglangScheduler"),
            timeout=10)
        self.assertEqual(health.status, health_pb2.HealthCheckResponse.SERVING)
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        replies = reflection_pb2_grpc.ServerReflectionStub(self.channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        services = {s.name for r in replies for s in r.list_services_response.service}
        self.assertIn("sglang.grpc.scheduler.SglangScheduler", services)
        self.assertIn("dxs.v1.Frontend", services)
        # The tokenizer bundle: a zip of the model directory's files, with its digest last.
        chunks = list(self.scheduler.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
        data = b"".join(c.data for c in chunks)
        self.assertEqual(chunks[-1].sha256, hashlib.sha256(data).hexdigest())
        self.assertTrue(all(c.sha256 == "" for c in chunks[:-1]))
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = set(z.namelist())
            for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json",
                      "config.json"]:
                self.assertIn(f, names)
                with open(os.path.join(self.model, f), "rb") as local:
                    self.assertEqual(z.read(f), local.read(), f)
        # Refusals name the field; streaming and logprobs on the protocol itself.
        req = sglang_pb2.GenerateRequest(request_id="refused-1")
        req.tokenized.input_ids.extend([5, 6])
        req.sampling_params.json_schema = "{}"
        with self.assertRaises(grpc.RpcError) as err:
            list(self.scheduler.Generate(req, timeout=10))
        self.assertEqual(err.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
        self.assertTrue(err.exception.details().startswith("sampling_params.json_schema"))
        req = sglang_pb2.GenerateRequest(request_id="refused-2", return_logprob=True,
                                         top_logprobs_num=21)
        req.tokenized.input_ids.extend([5, 6])
        req.sampling_params.max_new_tokens = 2
        with self.assertRaises(grpc.RpcError) as err:
            list(self.scheduler.Generate(req, timeout=10))
        self.assertEqual(err.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertTrue(err.exception.details().startswith("top_logprobs_num"),
                        err.exception.details())
        req = sglang_pb2.GenerateRequest(request_id="scored", stream=True, return_logprob=True,
                                         top_logprobs_num=2, logprob_start_len=0)
        req.tokenized.input_ids.extend([5, 6, 7])
        req.sampling_params.max_new_tokens = 3
        req.token_ids_logprob.extend([9, 10])
        msgs = list(self.scheduler.Generate(req, timeout=30))
        chunks = [m.chunk for m in msgs if m.HasField("chunk")]
        completes = [m.complete for m in msgs if m.HasField("complete")]
        self.assertEqual(len(completes), 1)
        self.assertEqual(sum(len(c.token_ids) for c in chunks), 3)
        self.assertEqual(list(completes[0].output_ids), [t for c in chunks for t in c.token_ids])
        self.assertEqual(len(completes[0].output_logprobs.token_logprobs), 3)
        self.assertEqual(len(completes[0].output_logprobs.token_ids_logprobs), 3)
        self.assertEqual(list(completes[0].output_logprobs.token_ids_logprobs[0].token_ids),
                         [9, 10])
        # Prompt scores: the first prompt token has none.
        self.assertEqual(len(completes[0].input_logprobs.token_logprobs), 3)
        self.assertFalse(completes[0].input_logprobs.token_logprobs[0].HasField("value"))
        self.assertTrue(completes[0].input_logprobs.token_logprobs[1].HasField("value"))
        self.assertEqual(completes[0].finish_reason, "length")

    def test_11_one_gateway_two_clusters(self):
        second = Cluster(self.tmp, "second", self.model, 1, 1)
        self.addCleanup(second.out.close)
        try:
            gateway_port, metrics_port = free_port(), free_port()
            smg = os.path.join(ARGS.source_dir, ".venv", "bin", "smg")
            log = open(os.path.join(self.tmp, "gateway2.log"), "w")
            self.addCleanup(log.close)
            gateway = subprocess.Popen(
                [smg, "launch", "--worker-urls", "grpc://" + self.cluster.address,
                 "grpc://" + second.address, "--host", "127.0.0.1", "--port", str(gateway_port),
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                 "--policy", "least_load"],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
            try:
                base = "http://127.0.0.1:%d" % gateway_port

                def two_workers():
                    assert gateway.poll() is None, "the gateway exited"
                    try:
                        text = http_get("http://127.0.0.1:%d/metrics" % metrics_port)
                    except OSError:
                        return False
                    # smg_worker_health: 1 per healthy worker.
                    return (metric_sum(text, "smg_worker_health") or 0) >= 2
                wait_for(two_workers, "the gateway to register both clusters",
                         timeout=START_TIMEOUT_S)
                client = openai.OpenAI(base_url=base + "/v1", api_key="none",
                                       timeout=EVENT_TIMEOUT_S)
                wait_for(lambda: self._served(client), "the second gateway to serve")

                def requests_total(cluster):
                    return metric_sum(http_get("http://%s/metrics" %
                                               cluster.metrics_address("router")),
                                      "dxs_requests_total") or 0
                before = [requests_total(self.cluster), requests_total(second)]
                with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
                    results = list(pool.map(lambda i: client.chat.completions.create(
                        model="default", messages=[{"role": "user", "content": "spread %d" % i}],
                        max_tokens=24, extra_body={"ignore_eos": True}), range(48)))
                self.assertTrue(all(r.usage.completion_tokens == 24 for r in results))
                after = [requests_total(self.cluster), requests_total(second)]
                served = [a - b for a, b in zip(after, before)]
                self.assertEqual(sum(served), 48, served)
                self.assertGreater(min(served), 0, "both clusters should serve: %s" % served)

                # One cluster stops; the gateway keeps serving from the other.
                second.stop()
                for i in range(8):
                    r = client.chat.completions.create(
                        model="default", messages=[{"role": "user", "content": "after %d" % i}],
                        max_tokens=4)
                    self.assertEqual(r.usage.completion_tokens, 4)
            finally:
                stop_process(gateway)
        finally:
            second.stop()

    def _served(self, client):
        try:
            client.chat.completions.create(model="default",
                                           messages=[{"role": "user", "content": "ping"}],
                                           max_tokens=1)
            return True
        except openai.APIError:
            return False

    def test_13_a_gateway_elsewhere_takes_the_tokenizer_over_grpc(self):
        # A gateway on another host cannot read the model directory the router reports: it
        # falls back to GetTokenizer. Simulated with a mount namespace in which a tmpfs hides
        # the test's directory (the model's parent).
        if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
            self.skipTest("cannot make a mount namespace here (needs root)")
        gateway_port = free_port()
        smg = os.path.join(ARGS.source_dir, ".venv", "bin", "smg")
        log = open(os.path.join(self.tmp, "gateway-elsewhere.log"), "w")
        self.addCleanup(log.close)
        script = ('mount -t tmpfs none "$1" && test ! -e "$2" && shift 2 && exec "$@"')
        gateway = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", script, "sh", self.tmp, self.model, smg, "launch",
             "--worker-urls", "grpc://" + self.cluster.address, "--host", "127.0.0.1",
             "--port", str(gateway_port), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port()), "--policy", "least_load"],
            stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:1"))
        try:
            client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % gateway_port,
                                   api_key="none", max_retries=0, timeout=EVENT_TIMEOUT_S)

            def served():
                assert gateway.poll() is None, "the gateway exited; see gateway-elsewhere.log"
                return self._served(client)
            wait_for(served, "the gateway without the model directory to serve",
                     timeout=START_TIMEOUT_S)
            content = "Tokenizer over gRPC"
            prompt = self.chat_prompt_ids(content)
            want = self.dxs_generate(prompt, 8)["tokens"]
            r = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": content}],
                max_tokens=8, temperature=0)
            self.assertEqual(r.choices[0].message.content, self.decode(want))
            self.assertEqual(r.usage.prompt_tokens, len(prompt))
            # It did come over GetTokenizer (smg 1.13 logs the bundle it read).
            with open(log.name) as f:
                self.assertIn("GetTokenizer bundle", f.read())
        finally:
            stop_process(gateway)

    def test_12_dashboard_gateway_metrics_exist(self):
        # Every smg_* series the Grafana dashboard's gateway row queries is one the running
        # gateway exports (after the requests above: streams, errors, tokens).
        with open(os.path.join(ARGS.source_dir, "deploy", "grafana", "dxs-dashboard.json")) as f:
            names = set(re.findall(r"\b(smg_[a-z_]+)", f.read()))
        self.assertTrue(names, "the dashboard has no gateway panels")
        text = http_get("http://127.0.0.1:%d/metrics" % self.cluster.gateway_metrics_port)
        exported = set(re.findall(r"^(smg_[a-z_]+)", text, re.M))
        self.assertEqual(sorted(n for n in names if n not in exported), [])

    def test_99_sigterm_stops_the_gateway_too(self):
        self.cluster.stop()
        self.assertEqual(self.cluster.proc.returncode, 0)
        # Nothing of the cluster is left: no process mentions its temp dir or the gateway's
        # port.
        marks = [self.tmp.encode(), b"--port\x00%d\x00" % self.cluster.gateway_port]
        leftover = []
        for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                with open(cmdline, "rb") as f:
                    text = f.read()
            except OSError:
                continue
            if any(m in text for m in marks):
                leftover.append(text.replace(b"\x00", b" ").decode(errors="replace"))
        self.assertEqual(leftover, [])


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--source-dir", required=True)
    ARGS, rest = parser.parse_known_args()
    try:
        import openai  # noqa: F401
        import smg_grpc_proto  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        print("the gateway test needs scripts/setup.sh's venv (%s)" % e)
        return 77
    if not os.path.exists(os.path.join(ARGS.source_dir, ".venv", "bin", "smg")):
        print("the gateway test needs smg in .venv (scripts/setup.sh)")
        return 77
    result = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2).result
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
