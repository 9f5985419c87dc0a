"""Reading and writing weights: checkpoint folders and shards, NVIDIA's float32 release, MLX's
quantizer (docs/checkpoints.md)."""
