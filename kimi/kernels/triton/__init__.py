"""kimi's Triton kernels, one module per op with its launcher and the plain-torch reference it is tested against."""
