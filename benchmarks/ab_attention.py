"""benchmarks/ab.py on a short list of attention forward cases, against cuDNN SDPA:
`python benchmarks/ab_attention.py NAME=SO ... [--rounds R] [--out FILE]` from the tree's root.

`ab.py --suite attention` builds every case of the sweep (60, each probing a fresh torch.compile
peer) before --only filters, a few minutes of GPU time; this builds only CASES (or the indexes in
AB_ATTENTION_CASES, e.g. "0,1,10"), with torch's cuDNN backend (the fastest SDPA backend at these
shapes, bench_attention's "cudnn") as the peer ab.py prints in its "compile" column.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from torch.nn.attention import SDPBackend

import ab
from fastkern import bench_attention as ba

# (batch, S, heads, D, causal), bf16 forward: the short sequences D-135 worked on, and two long ones
CASES = [(32, 512, 32, 64, False), (32, 512, 32, 64, True), (16, 1024, 32, 64, False), (16, 1024, 32, 64, True),
         (8, 2048, 32, 64, True), (32, 512, 16, 128, False), (32, 512, 16, 128, True), (16, 1024, 16, 128, True),
         (4, 4096, 16, 128, False), (4, 4096, 16, 128, True), (1, 16384, 32, 64, False)]
if os.environ.get("AB_ATTENTION_CASES"):
    CASES = [CASES[int(i)] for i in os.environ["AB_ATTENTION_CASES"].split(",")]


def cases(device, quick=False):
    ba._peers = lambda device, gqa: {"compile": ba._torch_sdpa(SDPBackend.CUDNN_ATTENTION, gqa)}
    for b, s, h, d, causal in CASES:
        name, nbytes, make, impls, extra = ba._case(device, b, s, s, h, h, d, causal, False, torch.bfloat16)
        impls.pop("fastkern_sm80", None)  # forced sm_80 path: not timed by ab.py
        yield name, nbytes, make, impls, extra


if __name__ == "__main__":
    ab.SUITES["attention"] = cases
    sys.argv[1:1] = ["--suite", "attention"]
    ab.main()
