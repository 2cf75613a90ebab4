"""The decoding core: the DFlash loop, sampling and acceptance, rollback, the model pair."""
