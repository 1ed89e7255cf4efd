#!/usr/bin/env python3
"""Serving through the SMG gateway against dxs.v1 directly (a benchmark, not a test).

One cluster (`dxs up --gateway-port`, 2 attention and 2 expert workers by default), one
workload: the same prompts, the same max_tokens (ignore_eos, greedy), at each concurrency
level, sent either straight to the router's dxs.v1.Frontend.Generate (grpc.aio, streaming;
the prompt as the token ids the model's tokenizer gives) or to the gateway's OpenAI
/v1/completions (the prompt as text, which the gateway tokenizes to the same ids, checked on
every request; streaming, over a lean asyncio HTTP client: run_gateway). Both clients are
asyncio Python in this process. The two paths alternate, ROUNDS times per level, so a burst
of load elsewhere hits both; each figure is the median over the rounds.

Prints, per level: output tokens/s of each path and their ratio (gateway / direct), and
the time to first token p50 of each path (from sending the request to the first chunk
carrying a token) and their difference. On a small machine the gateway's CPU time comes
out of the cluster's: the figure is then the gateway's cost where it shares the cores.

    .venv/bin/python3 bench/gateway_bench.py --bin-dir build/bin [--attention 2 --experts 2]
        [--concurrency 1,16,64] [--requests 64] [--prompt-len 32] [--output-len 32]
        [--rounds 3]
"""
import argparse
import asyncio
import glob
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_direct(stub, frontend_pb2, prompts, output_len, concurrency):
    """dxs.v1 Generate, streamed: (completion tokens, wall seconds, TTFTs)."""
    semaphore = asyncio.Semaphore(concurrency)
    ttfts, tokens = [], 0

    async def one(prompt):
        nonlocal tokens
        async with semaphore:
            req = frontend_pb2.GenerateRequest(prompt_token_ids=prompt["ids"])
            req.sampling_params.max_new_tokens = output_len
            req.sampling_params.temperature = 0.0
            req.sampling_params.ignore_eos = True
            start = time.perf_counter()
            first = None
            async for msg in stub.Generate(req, timeout=600):
                if msg.HasField("chunk") and msg.chunk.token_ids:
                    if first is None:
                        first = time.perf_counter() - start
                elif msg.HasField("complete"):
                    tokens += msg.complete.completion_tokens
            ttfts.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return tokens, time.perf_counter() - start, ttfts


async def run_gateway(address, model, prompts, output_len, concurrency):
    """/v1/completions through SMG, streamed: (completion tokens, wall seconds, TTFTs).

    A lean client, so that the client's own CPU time (which shares the machine's cores with
    the cluster and the gateway) weighs no more than grpc.aio's on the direct path: one
    HTTP/1.0 request per connection (the body ends when the connection closes, no chunked
    framing), bytes scanned for the first event with text, JSON parsed only for the usage
    event at the end."""
    host, port = address.split(":")
    semaphore = asyncio.Semaphore(concurrency)
    ttfts, tokens = [], 0

    async def one(prompt):
        nonlocal tokens
        async with semaphore:
            body = json.dumps({"model": model, "prompt": prompt["text"], "max_tokens": output_len,
                               "temperature": 0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}).encode()
            head = ("POST /v1/completions HTTP/1.0\r\nHost: %s\r\nContent-Type: "
                    "application/json\r\nContent-Length: %d\r\n\r\n" % (address, len(body)))
            start = time.perf_counter()
            first = None
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head.encode() + body)
            await writer.drain()
            data = b""
            while True:
                block = await reader.read(65536)
                if not block:
                    break
                data += block
                if first is None and re.search(rb'"text":"[^"]', data):
                    first = time.perf_counter() - start
            writer.close()
            status = int(data.split(b" ", 2)[1])
            if status != 200:
                raise RuntimeError("gateway: HTTP %d: %s" % (status, data[:300]))
            usage = None
            for line in data.split(b"\n"):
                if line.startswith(b"data: {") and b'"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]
            tokens += usage["completion_tokens"]
            # The same workload: the gateway's tokenization is the direct path's.
            assert usage["prompt_tokens"] == len(prompt["ids"])
            ttfts.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return tokens, time.perf_counter() - start, ttfts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin-dir", default="build/bin")
    p.add_argument("--source-dir", default=os.path.join(os.path.dirname(__file__), ".."))
    p.add_argument("--attention", type=int, default=2)
    p.add_argument("--experts", type=int, default=2)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--requests", type=int, default=64,
                   help="requests per level and path (at least 2x the concurrency is used)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="dxs_gateway_bench_")
    gen = os.path.join(tmp, "gen")
    os.makedirs(gen)
    proto_root = os.path.join(args.source_dir, "proto")
    from grpc_tools import protoc
    assert protoc.main(["protoc", "-I" + proto_root, "--python_out=" + gen,
                        "--grpc_python_out=" + gen] +
                       sorted(glob.glob(os.path.join(proto_root, "dxs", "v1", "*.proto")))) == 0
    sys.path.insert(0, gen)
    import grpc
    from dxs.v1 import frontend_pb2, frontend_pb2_grpc

    dxs = os.path.join(args.bin_dir, "dxs")
    model = os.path.join(tmp, "default")
    subprocess.run([dxs, "gen-model", "--out", model], check=True, stdout=subprocess.DEVNULL)
    port, gateway_port = free_port(), free_port()
    log = open(os.path.join(tmp, "up.log"), "w+")
    up = subprocess.Popen([dxs, "up", "--model", model, "--attention", str(args.attention),
                           "--experts", str(args.experts), "--port", str(port),
                           "--gateway-port", str(gateway_port), "--gateway-metrics-port",
                           str(free_port()), "--log-dir", os.path.join(tmp, "logs")],
                          stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while True:
            log.seek(0)
            if "gateway (OpenAI API) on" in log.read():
                break
            if up.poll() is not None or time.time() > deadline:
                raise SystemExit("dxs up did not come up; see " + log.name)
            time.sleep(0.2)

        import tokenizers
        tokenizer = tokenizers.Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        rng = random.Random(0)

        def make_prompts(n, length):
            # Text of ordinary tokens (above the special ones and the byte symbols), and its
            # ids as the gateway's tokenizer makes them.
            out = []
            for _ in range(n):
                text = tokenizer.decode([rng.randrange(300, 4000) for _ in range(length)])
                out.append({"text": text, "ids": tokenizer.encode(text).ids})
            return out
        levels = [int(c) for c in args.concurrency.split(",")]

        async def bench():
            channel = grpc.aio.insecure_channel("127.0.0.1:%d" % port)
            stub = frontend_pb2_grpc.FrontendStub(channel)
            client = "127.0.0.1:%d" % gateway_port
            # Warm-up: both paths, once.
            warm = make_prompts(4, args.prompt_len)
            await run_direct(stub, frontend_pb2, warm, 4, 4)
            await run_gateway(client, "default", warm, 4, 4)
            rows = []
            for c in levels:
                n = max(args.requests, 2 * c)
                prompts = make_prompts(n, args.prompt_len)
                direct, gateway = [], []
                for _ in range(args.rounds):
                    direct.append(await run_direct(stub, frontend_pb2, prompts,
                                                   args.output_len, c))
                    gateway.append(await run_gateway(client, "default", prompts,
                                                     args.output_len, c))
                for runs in (direct, gateway):
                    for tokens, _, _ in runs:
                        assert tokens == n * args.output_len, (tokens, n * args.output_len)
                tps_d = statistics.median(t / s for t, s, _ in direct)
                tps_g = statistics.median(t / s for t, s, _ in gateway)
                ttft_d = statistics.median(statistics.median(x) for _, _, x in direct) * 1e3
                ttft_g = statistics.median(statistics.median(x) for _, _, x in gateway) * 1e3
                rows.append((c, n, tps_d, tps_g, ttft_d, ttft_g))
            await channel.close()
            return rows

        rows = asyncio.run(bench())
        print("\ngateway_bench: %d attention + %d expert workers, prompt %d, output %d tokens, "
              "median of %d rounds, %d cores" % (args.attention, args.experts, args.prompt_len,
                                                 args.output_len, args.rounds, os.cpu_count()))
        print("| concurrency | requests | dxs.v1 tokens/s | gateway tokens/s | ratio | "
              "TTFT p50 dxs.v1 ms | TTFT p50 gateway ms | delta ms |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for c, n, tps_d, tps_g, ttft_d, ttft_g in rows:
            print("| %d | %d | %.0f | %.0f | %.3f | %.1f | %.1f | %+.1f |" %
                  (c, n, tps_d, tps_g, tps_g / tps_d, ttft_d, ttft_g, ttft_g - ttft_d))
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()


if __name__ == "__main__":
    main()
