"""The engine: the single MLX worker thread, its queue, model loading and the prefix cache."""
