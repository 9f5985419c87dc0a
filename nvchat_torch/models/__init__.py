"""The networks, one per module, with their caches, their layers, the quantized modules and the fused
CPU kernels (docs/design.md, "The map"). Nothing here knows about sessions or servers."""
