"""The generation core: target wrapper, exact rollback, sampling, the DFlash loop."""
