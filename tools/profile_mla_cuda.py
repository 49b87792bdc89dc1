"""kimi's CUDA MLA decode (kimi.ops.mla_decode_cuda) and FlashInfer's fa3 MLA decode at one decode shape, a few eager
calls each: the target for Nsight Compute, e.g.

    ncu --kernel-name regex:"mla_decode_kernel|BatchMLA" --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats python3 tools/profile_mla_cuda.py --batch 32 --splits 4

Inputs as tools/bench_mla_cuda.py: B requests at --ctx tokens, 64 heads, 512 + 64 latent, block_size 64, blocks
randomly permuted. Prints each kernel's median time over --calls event-timed calls (meaningless under ncu).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kimi.ops import mla_decode_cuda as mdc  # noqa: E402

H, L, R, BS, SCALE = 64, 512, 64, 64, 0.1308


def timed(fn, calls: int) -> float:
    ts = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--splits", type=int, default=None, help="KV splits of kimi's kernel (default: its choice)")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_mla_cuda: needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, nb = args.batch, -(-args.ctx // BS)
    kv = torch.randn(B * nb + 1, BS, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = (torch.randperm(B * nb, device="cuda", generator=g) + 1).view(B, nb).to(torch.int32)
    q_lat = torch.randn(B, H, L, device="cuda", dtype=torch.bfloat16, generator=g)
    q_pe = torch.randn(B, H, R, device="cuda", dtype=torch.bfloat16, generator=g)
    seq = torch.full((B,), args.ctx, dtype=torch.int32, device="cuda")
    out = torch.empty(B, H, L, device="cuda", dtype=torch.bfloat16)
    ns = args.splits or mdc.choose_num_splits(B, torch.cuda.get_device_properties(0).multi_processor_count, args.ctx)
    ours = timed(lambda: mdc.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out, num_splits=ns), args.calls)
    print(f"kimi cuda (splits {ns}): {ours:.1f} us")
    from kimi.ops.attention_flashinfer import FlashInferMLADecode

    m = FlashInferMLADecode(H, SCALE, backend="fa3")
    m.plan([args.ctx] * B, bt, BS)
    print(f"flashinfer fa3: {timed(lambda: m.run(q_lat, q_pe, kv, out=out), args.calls):.1f} us")


if __name__ == "__main__":
    main()
