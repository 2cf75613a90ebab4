"""dflash-server: DFlash block-diffusion speculative decoding on MLX, served OpenAI-style.

The Python API mirrors the reference ``dflash.model_mlx`` module: code written against it runs with
only its import line changed. Its names are imported on first use, so that ``dflash-serve
--version`` and every ``--help`` answer without loading MLX, mlx-lm and transformers.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing itself is not imported: it costs tens of ms before every command
if TYPE_CHECKING:
    from typing import Any

    from dflash_server.drafters.config import DFlashConfig
    from dflash_server.drafters.dflash import DFlashDraftModel
    from dflash_server.drafters.registry import load_draft, load_drafter
    from dflash_server.generation.sampling_params import SamplingParams
    from dflash_server.generation.stats import SpeculativeStats
    from dflash_server.generation.stream import GenerationResponse, stream_generate
    from dflash_server.models.loading import load
    from dflash_server.models.vision import load_vision

# Each public name and the module it lives in.
_EXPORTS = {
    "DFlashConfig": "dflash_server.drafters.config",
    "DFlashDraftModel": "dflash_server.drafters.dflash",
    "GenerationResponse": "dflash_server.generation.stream",
    "SamplingParams": "dflash_server.generation.sampling_params",
    "SpeculativeStats": "dflash_server.generation.stats",
    "load": "dflash_server.models.loading",
    "load_draft": "dflash_server.drafters.registry",
    "load_drafter": "dflash_server.drafters.registry",
    "load_vision": "dflash_server.models.vision",
    "stream_generate": "dflash_server.generation.stream",
}
__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "GenerationResponse",
    "SamplingParams",
    "SpeculativeStats",
    "load",
    "load_draft",
    "load_drafter",
    "load_vision",
    "stream_generate",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_server' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
