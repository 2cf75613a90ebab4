"""Drafter tooling: ``dflash-serve convert`` (quantize/cast) and ``dflash-serve train`` (distil)."""
