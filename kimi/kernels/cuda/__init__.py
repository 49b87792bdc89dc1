"""kimi's CUDA C++ kernels: csrc/ (package data), the extension loader, and each kernel's launcher."""
