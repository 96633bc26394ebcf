"""mlx-pte: export Hugging Face causal LMs to ExecuTorch .pte files and run them on MLX."""
