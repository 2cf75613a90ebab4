"""Engine: the single MLX worker thread, its queue, prompt rendering and reasoning split."""
