"""The drafters: the contract (protocol.py), every family (one module each: DFlash, DFlash2, the
MTP head; suffix drafts, model-free), their context caches, and loading (registry.py)."""
