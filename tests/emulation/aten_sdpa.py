"""Emulations of the eight aten ops cpbench's `CudaSdpaKernel(ops=...)` calls, under the keys it takes.

    from tests.emulation.aten_sdpa import OPS, Counted
    kernel = CudaSdpaKernel(ops=OPS)            # or Counted() to count calls per key
    ops = Counted(); kernel = CudaSdpaKernel(ops=ops); ...; ops.calls["efficient_backward"]

Each takes exactly the real op's schema (positional and keyword arguments bound by `torch.ops.aten.X.default._schema`)
and returns what the op returns on an sm80+ GPU, computed in fp32 from the kernels' source: see aten_flash.py (flash
and varlen), aten_efficient.py (efficient) and aten_cudnn.py (cuDNN, on the GPU its TARGET names); CONTRACT is the
three tables.
"""

from __future__ import annotations

from . import aten_cudnn, aten_efficient, aten_flash

OPS = {
    "flash": aten_flash.sdpa_flash,  # aten._scaled_dot_product_flash_attention
    "flash_backward": aten_flash.sdpa_flash_backward,  # aten._scaled_dot_product_flash_attention_backward
    "efficient": aten_efficient.sdpa_efficient,  # aten._scaled_dot_product_efficient_attention
    "efficient_backward": aten_efficient.sdpa_efficient_backward,  # ..._efficient_attention_backward
    "varlen": aten_flash.flash_attention_forward,  # aten._flash_attention_forward (cum_seq_q/k, windows)
    "varlen_backward": aten_flash.flash_attention_backward,  # aten._flash_attention_backward
    "cudnn": aten_cudnn.sdpa_cudnn,  # aten._scaled_dot_product_cudnn_attention
    "cudnn_backward": aten_cudnn.sdpa_cudnn_backward,  # aten._scaled_dot_product_cudnn_attention_backward
}

CONTRACT = aten_flash.CONTRACT + aten_efficient.CONTRACT + aten_cudnn.CONTRACT


class Counted:
    """OPS behind a counter: `ops[key]` is the emulation, counting its calls in `ops.calls[key]`."""

    def __init__(self, ops: dict | None = None):
        self.fns = dict(ops or OPS)
        self.calls = {key: 0 for key in self.fns}

    def __getitem__(self, key):
        fn = self.fns[key]

        def call(*args, **kwargs):
            self.calls[key] += 1
            return fn(*args, **kwargs)

        return call

    def __contains__(self, key):
        return key in self.fns

    def keys(self):
        return self.fns.keys()
