"""The model: KimiForCausalLM (model.py) and its math and layers -- MLA attention, MoE / dense MLP and routing, RMSNorm,
rotary embeddings, INT4 / FP8 quantisation, sampling -- in plain PyTorch (the CPU path and the references the GPU
kernels are tested against); the fused GPU forward (gpu_forward.py) calls kimi.backends; weights.py installs the
weights."""
