#!/usr/bin/env python3
"""Times epcomm.AllToAll from Python the way pplx-kernels' tests/bench_all_to_all.py does, so the two tables can
be compared line by line: per sample a barrier, then CUDA events around dispatch, combine, and a dense
torch.distributed.all_to_all_single of the same bytes (the NCCL baseline); 10 samples per run, warm-up runs,
then mean ± std over repeated runs. Prints a table and one JSON line per row. Nothing is asserted.

    torchrun --nproc-per-node 2 bench/python/bench_all_to_all.py --config decode
    python bench/python/bench_all_to_all.py --sweep            # spawns one process per visible GPU
"""

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

import epcomm

# name -> (E, K, H, tokens, dispatch dtype, fp32 scale block (0 = none), combine dtype); SPEC section 3.
STANDARD = {
    "decode": (256, 8, 7168, 128, "float8_e4m3fn", 128, "bfloat16"),
    "prefill": (256, 8, 7168, 4096, "float8_e4m3fn", 128, "bfloat16"),
    "small": (64, 6, 2048, 128, "bfloat16", 0, "bfloat16"),
    "qwen3": (128, 8, 2048, 128, "bfloat16", 0, "bfloat16"),
}
# pplx-kernels' sweep: V2-Lite and R1 shapes at 1..128 tokens.
SWEEP_TOKENS = [1, 4, 8, 16, 32, 64, 128]


def routing(num_tokens: int, num_experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Uniform random top-k without repeats (SPEC section 3)."""
    return torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(num_tokens)]).to(torch.int32)


@torch.inference_mode()
def bench_one(rank: int, world: int, dp_size: int, shape: Tuple, backend: str, samples: int, warmup: int,
              repeat: int, split: bool) -> Dict[str, float]:
    E, K, H, T, in_name, block, out_name = shape
    in_dtype, out_dtype = getattr(torch, in_name), getattr(torch, out_name)
    device = torch.device("cuda", torch.cuda.current_device())
    item = torch.empty(0, dtype=in_dtype).element_size()
    scale_cols = (H + block - 1) // block if block else 0
    a2a = epcomm.AllToAll(T, E, K, rank, world, dp_size, H, H * item, scale_cols * 4, backend=backend,
                          group=dist.group.WORLD)
    # Identical tokens inside a DP group, as the contract requires.
    gen = torch.Generator().manual_seed(rank // dp_size + 1)
    x = torch.randn(T, H, generator=gen).to(in_dtype).to(device)
    x_scale = torch.rand(T, scale_cols, generator=gen).to(device) if scale_cols else None
    indices = routing(T, E, K, gen).to(device)
    weights = torch.rand(T, K, generator=gen).to(device)
    bound_m = torch.tensor([T], dtype=torch.int32, device=device)
    num, expert_x, expert_x_scale = a2a.alloc_dispatch_outputs(in_dtype)
    expert_y = a2a.alloc_expert_y(out_dtype)
    out = a2a.alloc_combine_output(T, out_dtype)

    # The dense baseline moves what pplx's does: every token once per expert, payload + scales.
    bytes_per_token = H // dp_size * item + (scale_cols * 4 if scale_cols else 0)
    a2a_in = torch.empty(world, E // world, T * bytes_per_token, dtype=torch.uint8, device=device)
    a2a_out = torch.empty_like(a2a_in)
    dispatch_bytes = T * K * bytes_per_token
    combine_bytes = T * K * (H // dp_size) * out.element_size()
    torch_bytes = a2a_in.numel()

    def run() -> List[float]:
        n_ev = 6 if split else 4
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(n_ev)] for _ in range(samples)]
        stream = torch.cuda.current_stream()
        for ev in events:
            torch.cuda.synchronize()
            dist.barrier()
            ev[0].record(stream)
            if split:
                a2a.dispatch(num, expert_x, expert_x_scale, x, x_scale, indices, bound_m, do_send=True, do_recv=False)
                ev[4].record(stream)
                a2a.dispatch(num, expert_x, expert_x_scale, x, x_scale, indices, bound_m, do_send=False, do_recv=True)
            else:
                a2a.dispatch(num, expert_x, expert_x_scale, x, x_scale, indices, bound_m)
            ev[1].record(stream)
            if split:
                a2a.combine(out, indices, weights, expert_y, bound_m, do_send=True, do_recv=False)
                ev[5].record(stream)
                a2a.combine(out, indices, weights, expert_y, bound_m, do_send=False, do_recv=True)
            else:
                a2a.combine(out, indices, weights, expert_y, bound_m)
            ev[2].record(stream)
            dist.all_to_all_single(a2a_out, a2a_in)
            ev[3].record(stream)
        stream.synchronize()
        mean = lambda f: sum(f(ev) for ev in events) / samples * 1e3  # noqa: E731 -- ms -> us
        row = [mean(lambda e: e[0].elapsed_time(e[1])), mean(lambda e: e[1].elapsed_time(e[2])),
               mean(lambda e: e[2].elapsed_time(e[3]))]
        if split:
            row += [mean(lambda e: e[0].elapsed_time(e[4])), mean(lambda e: e[1].elapsed_time(e[5]))]
        return row

    for _ in range(warmup):
        run()
    dist.barrier()
    runs = [run() for _ in range(repeat)]
    a2a.destroy()
    cols = list(zip(*runs))
    res = {
        "dispatch_us": statistics.mean(cols[0]), "dispatch_std": statistics.pstdev(cols[0]),
        "combine_us": statistics.mean(cols[1]), "combine_std": statistics.pstdev(cols[1]),
        "torch_us": statistics.mean(cols[2]), "torch_std": statistics.pstdev(cols[2]),
        "dispatch_bytes": dispatch_bytes, "combine_bytes": combine_bytes, "torch_bytes": torch_bytes,
    }
    if split:
        res["dispatch_send_us"] = statistics.mean(cols[3])
        res["combine_send_us"] = statistics.mean(cols[4])
    for key in ("dispatch", "combine", "torch"):
        res[f"{key}_gbps"] = res[f"{key}_bytes"] / res[f"{key}_us"] / 1e3
    return res


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
    shapes: List[Tuple[str, Tuple]] = []
    if args.sweep:
        for t in SWEEP_TOKENS:
            shapes.append((f"v2lite-{t}", (64, 6, 2048, t, args.in_dtype or "float8_e4m3fn", 128, "bfloat16")))
        for t in SWEEP_TOKENS:
            shapes.append((f"r1-{t}", (256, 8, 7168, t, args.in_dtype or "float8_e4m3fn", 128, "bfloat16")))
    else:
        for name in args.config:
            E, K, H, T, in_name, block, out_name = STANDARD[name]
            if args.tokens:
                T = args.tokens
            if args.in_dtype:
                in_name = args.in_dtype
                block = 128 if in_name == "float8_e4m3fn" else 0
            shapes.append((name, (E, K, H, T, in_name, block, out_name)))
    header = f"{'config':<12} {'E':>4} {'K':>2} {'H':>5} {'tok':>5}  {'dispatch us':>18} {'combine us':>18} " \
             f"{'torch a2a us':>18} {'disp GB/s':>9} {'comb GB/s':>9}"
    if rank == 0:
        print(f"epcomm {epcomm.__version__} backend={args.backend} EP={world} DP={world // args.dp_size} "
              f"(barrier + CUDA events per sample; {args.samples} samples x {args.repeat} runs)")
        print(header)
    for name, shape in shapes:
        if world > shape[0]:
            continue
        res = bench_one(rank, world, args.dp_size, shape, args.backend, args.samples, args.warmup, args.repeat,
                        args.split)
        if rank == 0:
            E, K, H, T = shape[:4]
            fmt = lambda k: f"{res[k + '_us']:8.1f} ± {res[k + '_std']:6.1f}"  # noqa: E731
            print(f"{name:<12} {E:>4} {K:>2} {H:>5} {T:>5}  {fmt('dispatch'):>18} {fmt('combine'):>18} "
                  f"{fmt('torch'):>18} {res['dispatch_gbps']:9.2f} {res['combine_gbps']:9.2f}")
            print(json.dumps(dict(bench="python_all_to_all", config=name, E=E, K=K, H=H, tokens=T, world=world,
                                  dp=args.dp_size, backend=args.backend, **res)), file=sys.stderr if args.quiet_json
                  else sys.stdout)
            sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    worker(rank, world, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["decode", "small"], choices=sorted(STANDARD))
    p.add_argument("--sweep", action="store_true", help="pplx-kernels' sweep (V2-Lite and R1 at 1..128 tokens)")
    p.add_argument("--tokens", type=int, default=0, help="override tokens per rank")
    p.add_argument("--in-dtype", choices=["bfloat16", "float16", "float8_e4m3fn"], default=None)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--backend", default="auto")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--split", action="store_true", help="also time the send halves (do_send / do_recv split)")
    p.add_argument("--quiet-json", action="store_true", help="JSON lines to stderr instead of stdout")
    args = p.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    world = torch.cuda.device_count()
    if world < 1:
        sys.exit("bench_all_to_all: no CUDA device")
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(world, epcomm.free_port(), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
