"""Upstream ExecuTorch MLX programs (payload magic ``MLX0``), imported into the IR."""
