"""Drafter modules (DFlash, DFlash2, config variants, loading) and the target's hooks."""
