"""D-131's kernel alone: FusedMLP's GELU work at h (16384, 4096) bf16, the backward with db1 plus a
separate gelu(h) (before) against one backward pass that also writes gelu(h) (after), and the plain
backward alone (whose kernels now carry the optional store). `python benchmarks/gelu_bwd_second_output.py`
(PYTHONPATH=python); prints microseconds and % of the copy rate for the bytes each moves."""
import torch

from fastkern import bench
from fastkern.ops.gelu import _gelu, _gelu_backward, _gelu_backward_and_gelu


def main(rows=16384, cols=4096, dtype=torch.bfloat16):
    device = torch.device("cuda")
    size = rows * cols * torch.finfo(dtype).bits // 8
    make = lambda: (torch.randn(rows, cols, device=device, dtype=dtype),
                    torch.randn(rows, cols, device=device, dtype=dtype) * 3,
                    torch.zeros(cols, device=device, dtype=dtype))
    copy = bench.copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name()}  copy {copy:.1f} GB/s  h {(rows, cols)} {str(dtype)[6:]}")
    for approximate in ("tanh", "none"):
        cases = {
            "bwd+db1 alone": (3, lambda g, h, z: _gelu_backward(g, h, z, approximate, True)),
            "bwd+db1, then gelu": (5, lambda g, h, z: (_gelu_backward(g, h, z, approximate, True),
                                                       _gelu(h, None, approximate))),
            "bwd+db1+gelu, one pass": (4, lambda g, h, z: _gelu_backward_and_gelu(g, h, z, approximate, True)),
        }
        for name, (tensors, fn) in cases.items():
            sets = bench.input_sets(make, device, tensors * size)
            ms = bench.time_ms(fn, sets, device)[0]
            print(f"{approximate:5s} {name:24s} {ms * 1e3:8.1f} us  {tensors * size / ms / 1e9 / copy * 100:5.1f}% of copy")


if __name__ == "__main__":
    main()
