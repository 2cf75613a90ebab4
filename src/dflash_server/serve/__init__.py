"""Composition: the engine and the app built from settings, and the ranks that follow rank 0."""
