"""Graph rewrites: InterDecom pipelines and calls of the fused operators."""
