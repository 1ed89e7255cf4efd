#!/usr/bin/env python3
"""The client side of the hosts tests, run on a simulated host (inside its namespaces).

    hosts_client.py generate --router HOST:PORT --gen-dir DIR --spec FILE [--timeout S]
        Sends every request of FILE (a JSON list of {"prompt": [...], "max_new_tokens": N,
        "ignore_eos": bool}) at once, each on its own thread, through dxs.v1.Frontend.Generate
        (greedy; "dp_rank": R pins it to attention rank R). Prints one JSON line per event, flushed as it happens, with
        time.monotonic() (one clock for every namespace of the machine):
          {"i": I, "ev": "tokens", "n": tokens so far, "t": T}   per streamed chunk
          {"i": I, "ev": "end", "code": "OK" | gRPC code name, "details": ..., "tokens": [...],
           "t": T}
        then {"ev": "all_done", "t": T}.
        --keepalive-ms K (generate and load): see channel_options.
    hosts_client.py load --router HOST:PORT --gen-dir DIR --spec FILE --stop FILE
                         [--timeout S]
        Load that lasts until an event: FILE is a JSON list of streams, each a list of
        requests as above; each stream (its own thread) sends its requests one after another,
        round and round, until the --stop file exists (checked before each request), then
        ends. One JSON line per request:
          {"s": S, "k": K (the stream's K-th request), "j": index in the stream's list,
           "ev": "end", "code": ..., "details": ..., "tokens": [...], "t0": sent, "t": T}
        then {"ev": "all_done", "t": T}.
    hosts_client.py scrape --url URL
        Prints the body of URL (a /metrics page), or exits 1 with the error.
"""
import argparse
import json
import sys
import threading
import time
import urllib.request

_print_lock = threading.Lock()


def emit(obj):
    obj.setdefault("t", time.monotonic())
    line = json.dumps(obj)
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def channel_options(args):
    """--keepalive-ms K: HTTP/2 keepalive pings every K ms, each answered within K ms, or the
    connection (and every call on it) fails UNAVAILABLE; what a frontend does to notice a
    router it can no longer reach (dxs servers accept pings every second)."""
    # Reconnect soon after the router is back (gRPC's default backoff grows to minutes).
    backoff = [("grpc.initial_reconnect_backoff_ms", 100),
               ("grpc.min_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 500)]
    if not args.keepalive_ms:
        return backoff
    return backoff + [("grpc.keepalive_time_ms", args.keepalive_ms),
            ("grpc.keepalive_timeout_ms", args.keepalive_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


def generate(args):
    sys.path.insert(0, args.gen_dir)
    import grpc
    from dxs.v1 import frontend_pb2, frontend_pb2_grpc

    with open(args.spec) as f:
        spec = json.load(f)
    channel = grpc.insecure_channel(args.router, options=channel_options(args))
    stub = frontend_pb2_grpc.FrontendStub(channel)

    def one(i, req_spec):
        req = frontend_pb2.GenerateRequest(prompt_token_ids=req_spec["prompt"])
        req.sampling_params.max_new_tokens = req_spec["max_new_tokens"]
        req.sampling_params.temperature = 0.0
        req.sampling_params.ignore_eos = bool(req_spec.get("ignore_eos", False))
        if "dp_rank" in req_spec:
            req.data_parallel_rank = req_spec["dp_rank"]
        tokens = []
        try:
            for msg in stub.Generate(req, timeout=args.timeout):
                if msg.HasField("chunk"):
                    tokens.extend(msg.chunk.token_ids)
                    emit({"i": i, "ev": "tokens", "n": len(tokens)})
            emit({"i": i, "ev": "end", "code": "OK", "details": "", "tokens": tokens})
        except grpc.RpcError as e:
            emit({"i": i, "ev": "end", "code": e.code().name, "details": e.details() or "",
                  "tokens": tokens})
        except Exception as e:  # noqa: BLE001 - reported, never lost
            emit({"i": i, "ev": "end", "code": "CLIENT_ERROR", "details": repr(e),
                  "tokens": tokens})

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(spec)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emit({"ev": "all_done"})
    return 0


def load(args):
    sys.path.insert(0, args.gen_dir)
    import os
    import grpc
    from dxs.v1 import frontend_pb2, frontend_pb2_grpc

    with open(args.spec) as f:
        streams = json.load(f)
    channel = grpc.insecure_channel(args.router, options=channel_options(args))
    stub = frontend_pb2_grpc.FrontendStub(channel)

    def stream(s, reqs):
        k = 0
        while not os.path.exists(args.stop):
            j = k % len(reqs)
            req = frontend_pb2.GenerateRequest(prompt_token_ids=reqs[j]["prompt"])
            req.sampling_params.max_new_tokens = reqs[j]["max_new_tokens"]
            req.sampling_params.temperature = 0.0
            req.sampling_params.ignore_eos = bool(reqs[j].get("ignore_eos", False))
            tokens = []
            t0 = time.monotonic()
            ev = {"s": s, "k": k, "j": j, "ev": "end", "t0": t0}
            try:
                for msg in stub.Generate(req, timeout=args.timeout):
                    if msg.HasField("chunk"):
                        tokens.extend(msg.chunk.token_ids)
                ev.update(code="OK", details="")
            except grpc.RpcError as e:
                ev.update(code=e.code().name, details=e.details() or "")
            except Exception as e:  # noqa: BLE001 - reported, never lost
                ev.update(code="CLIENT_ERROR", details=repr(e))
            ev["tokens"] = tokens
            emit(ev)
            k += 1
            if ev["code"] != "OK":
                time.sleep(0.05)  # a client's pause before the next try

    threads = [threading.Thread(target=stream, args=(i, r)) for i, r in enumerate(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emit({"ev": "all_done"})
    return 0


def scrape(args):
    try:
        with urllib.request.urlopen(args.url, timeout=10) as r:
            sys.stdout.write(r.read().decode())
        return 0
    except Exception as e:  # noqa: BLE001
        sys.stderr.write("scrape %s: %r\n" % (args.url, e))
        return 1


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--router", required=True)
    g.add_argument("--gen-dir", required=True)
    g.add_argument("--spec", required=True)
    g.add_argument("--timeout", type=float, default=120)
    g.add_argument("--keepalive-ms", type=int, default=0)
    ld = sub.add_parser("load")
    ld.add_argument("--router", required=True)
    ld.add_argument("--gen-dir", required=True)
    ld.add_argument("--spec", required=True)
    ld.add_argument("--stop", required=True)
    ld.add_argument("--timeout", type=float, default=60)
    ld.add_argument("--keepalive-ms", type=int, default=0)
    s = sub.add_parser("scrape")
    s.add_argument("--url", required=True)
    args = ap.parse_args()
    return {"generate": generate, "load": load, "scrape": scrape}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
