"""What the model's hidden states become: pooling, scoring heads, per-token outputs."""
