#!/usr/bin/env python3
"""The PyTorch baselines of the dispatch + combine benchmarks on several GPUs: W ranks,
one process and one GPU each, over NCCL (torch.distributed), every rank both a DP and an EP
rank, 128 experts split evenly over the ranks, top-8, bf16 rows.

  user:   dispatch + combine as a PyTorch user writes it: the per-rank token counts through
          all_to_all_single, a host sync for them (.tolist()), the rows through
          all_to_all_single (a token goes once to each rank holding any of its top-8
          experts), the experts the identity, the rows back through all_to_all_single and
          the combine's index_add_ into the output.
  nccl:   all_to_all_single of equal splits alone, tokens x hidden rows to every rank.
  copy:   (W >= 2) the copy rate between GPUs 0 and 1: 256 MiB, one way, tensor.copy_.

Timing: CUDA events on every rank around each round trip, a barrier before each (outside
the timing), 10 warm-up round trips, the median over the round trips of the slowest rank.
Seeded random inputs (never zeros); the user pattern's output is checked against the
input (identity experts: every token comes back once per rank it went to).
Usage: torch_all_to_all.py [--world W (default: the GPUs here)] [--reps N] [--json FILE]
Prints a table; with --json, one object per figure (section "torch_all_to_all").
"""
import argparse
import json
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch_baselines import time_ms  # bench/gpu/, beside this script

EXPERTS, TOP_K = 128, 8
TOKENS = (1, 128, 1024, 4096)
HIDDENS = (2048, 7168)


def timed(fn, reps, warmup=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)  # us
    # The slowest rank of each round trip.
    t = torch.tensor(times, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def user_round_trip(x, ids, world):
    """One dispatch + combine the way a PyTorch user writes it; returns the output."""
    tokens = x.shape[0]
    owner = ids // (EXPERTS // world)  # [T, k]: the rank of each pair's expert
    goes = torch.zeros(tokens, world, dtype=torch.bool, device=x.device)
    goes.scatter_(1, owner, True)  # a token goes once to each rank holding any of its experts
    send_counts = goes.sum(0)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()  # the host sync
    rank_token = goes.t().nonzero()  # (rank, token), by rank
    rows = x.index_select(0, rank_token[:, 1])
    received = x.new_empty(sum(recv_split), x.shape[1])
    dist.all_to_all_single(received, rows, recv_split, send_split)
    answers = received  # the experts: the identity
    back = x.new_empty(rows.shape)
    dist.all_to_all_single(back, answers, send_split, recv_split)
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, rank_token[:, 1], back.float())
    return out, goes.sum(1)


def worker(rank, world, port, reps, queue):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    rows = []
    for hidden in HIDDENS:
        for tokens in TOKENS:
            x = (torch.rand(tokens, hidden, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
            ids = torch.randint(0, EXPERTS, (tokens, TOP_K), device="cuda", generator=g)
            out, copies = user_round_trip(x, ids, world)
            want = x.float() * copies.unsqueeze(1).float()
            if not torch.equal(out, want):
                raise SystemExit(f"rank {rank}: the user pattern's output is wrong")
            user_us = timed(lambda: user_round_trip(x, ids, world), reps)
            send = x.repeat(world, 1)
            recv = torch.empty_like(send)
            nccl_us = timed(lambda: dist.all_to_all_single(recv, send), reps)
            rows.append({"hidden": hidden, "tokens": tokens, "user_us": round(user_us, 2),
                         "nccl_us": round(nccl_us, 2)})
    copy = None
    if world >= 2 and rank == 0:
        n = 256 << 20
        a = torch.ones(n, dtype=torch.uint8, device="cuda:0")
        b = torch.empty(n, dtype=torch.uint8, device="cuda:1")
        copy = n / (time_ms(lambda: b.copy_(a, non_blocking=True)) / 1000.0) / 1e9
    if rank == 0:
        queue.put((rows, copy))
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.world < 1 or args.world > torch.cuda.device_count():
        print(f"torch_all_to_all: --world {args.world}, but {torch.cuda.device_count()} GPU(s) here",
              file=sys.stderr)
        return 2
    if EXPERTS % args.world != 0:
        print(f"torch_all_to_all: {EXPERTS} experts do not split over {args.world} ranks",
              file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, args=(args.world, port, args.reps, queue), nprocs=args.world, join=True)
    rows, copy = queue.get()
    print(f"PyTorch dispatch + combine over {args.world} rank(s) ({torch.cuda.get_device_name(0)}), "
          f"top-{TOP_K} of {EXPERTS}, bf16; median of the slowest rank")
    print(f"{'hidden':>6} {'tokens':>6} {'user us':>10} {'a2a us':>10}")
    for r in rows:
        print(f"{r['hidden']:>6} {r['tokens']:>6} {r['user_us']:>10.1f} {r['nccl_us']:>10.1f}")
    if copy is not None:
        print(f"GPU 0 -> 1 copy: {copy:.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps({"section": "torch_all_to_all", "world": args.world, **r}) + "\n")
            if copy is not None:
                f.write(json.dumps({"section": "peer_copy", "gb_per_s": round(copy, 1)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
