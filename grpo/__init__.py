"""Building blocks for GRPO fine-tuning of FLUX under DeepSpeed ZeRO-3 (NPU, CUDA, CPU)."""
