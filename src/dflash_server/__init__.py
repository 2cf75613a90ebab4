"""dflash-server: DFlash block-diffusion speculative decoding on MLX, served OpenAI-style.

The Python API mirrors the reference ``dflash.model_mlx`` module: code written against it runs with
only its import line changed.
"""

from dflash_server.drafters.config import DFlashConfig
from dflash_server.drafters.dflash import DFlashDraftModel
from dflash_server.drafters.registry import load_draft, load_drafter
from dflash_server.generation.sampling import SamplingParams
from dflash_server.generation.stats import SpeculativeStats
from dflash_server.generation.stream import GenerationResponse, stream_generate
from dflash_server.models.loading import load
from dflash_server.models.vision import load_vision

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
