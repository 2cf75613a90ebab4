"""Server settings: one pydantic-settings class.

Precedence, highest first: command-line flags > environment (``DFLASH_*``) > config file
(``--config``, TOML or JSON; a bare name picks a preset shipped in ``dflash_server/presets``) >
defaults. When no layer names a model at all, the default preset supplies target and drafter.
"""

from __future__ import annotations

import ipaddress
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from dflash_server.config_files import (
    DEFAULT_PRESET,
    ConfigFileSource,
    SettingsError,
    find_config,
    read_config_file,
)
from dflash_server.generation.kv_quant import (
    KV_BITS,
    KV_GROUP_SIZES,
    QUANTIZED_KV_START,
    KVQuant,
)
from dflash_server.generation.sampling_params import SERVED_FIELDS, SamplingParams

# Set by Settings.load() when no layer names a model: the default preset then sits beneath
# the user's config file inside the config-file layer.
_BASE_PRESET: ContextVar[str | None] = ContextVar("_BASE_PRESET", default=None)


# The sampling defaults: SamplingParams' fields and bounds, with the server's own default
# temperature (Qwen3.5 + DFlash is meant to be sampled; the Python API defaults to greedy).
_SERVER_DEFAULTS = {"temperature": 1.0}
_SamplingDefaults = create_model(  # type: ignore[call-overload]  # fields built at import
    "SamplingDefaults",
    **{
        name: (
            SamplingParams.model_fields[name].annotation,
            FieldInfo.merge_field_infos(
                SamplingParams.model_fields[name],
                default=_SERVER_DEFAULTS.get(name, SamplingParams.model_fields[name].default),
            ),
        )
        for name in SERVED_FIELDS
    },
)


class Settings(BaseSettings, _SamplingDefaults):
    """Everything `dflash-serve` can be told; see README "CLI reference"."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_", extra="forbid", validate_default=True)

    # Models
    target: str | None = Field(
        None, description="target model: hub id or local MLX folder (default: the preset's)"
    )
    draft: str | None = Field(
        None,
        description="drafter: a DFlash, DFlash2, DSpark or EAGLE-3 drafter (hub id, "
        "owner/name/folder, or local folder), 'mtp' (the target checkpoint's own MTP head) or "
        "'none' (suffix drafts and plain decoding); default: the preset's, or none with --target",
    )
    served_model_name: str | None = Field(
        None, description="model id shown by /v1/models (default: last part of --target)"
    )
    config: str | None = Field(
        None, description="TOML/JSON settings file, or a shipped preset's name"
    )
    hf_target: str | None = Field(
        None,
        description="original HF checkpoint of --target, for 'dflash-serve export' (vLLM/SGLang)",
    )
    models: str | None = Field(
        None,
        description="TOML file of [[models]] to serve, each loaded when a request names it "
        "(README: several models); instead of --target",
    )
    max_model_memory: str | int | None = Field(
        None,
        description="with --models: memory the loaded models may take together (weights, KV "
        "budgets, prefix caches; 48GB, bytes); the least recently used idle one is unloaded "
        "to make room (default: 3/4 of the machine's; 0 or 'none': no limit)",
    )
    model_ttl: float | None = Field(
        None,
        gt=0,
        description="with --models: seconds a model may stay idle before it is unloaded (a "
        "model's own 'ttl' wins; default: until memory is needed)",
    )

    # HTTP
    host: str = Field("127.0.0.1", description="bind address (0.0.0.0 exposes the server)")
    port: int = Field(8000, ge=0, le=65535, description="port")
    api_key: str | None = Field(
        None, description="require 'Authorization: Bearer <key>' on /v1/* (/health stays open)"
    )
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="CORS origins, comma separated ('*' for any)"
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "info", description="log level (only debug logs prompt text)"
    )
    keepalive: float = Field(
        10.0, gt=0, description="seconds between SSE keepalive comments (long prefills)"
    )
    stream_interval: float = Field(
        0.02, ge=0, description="min seconds between streamed text events (0: every step)"
    )
    max_request_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="largest request body; bigger ones get 413"
    )
    request_read_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds a request's headers, then its body, may take to arrive; slower "
        "clients get 408",
    )
    timeout_keep_alive: float = Field(
        75.0,
        gt=0,
        description="seconds an idle kept-alive connection stays open (longer than clients "
        "keep one, so none reuses a connection as it closes)",
    )
    shutdown_timeout: float = Field(
        5.0, ge=0, description="seconds in-flight requests may finish after SIGINT/SIGTERM"
    )
    web: bool = Field(True, description="serve the chat page at /")
    metrics: bool = Field(True, description="serve Prometheus metrics at /metrics")
    metrics_auth: bool = Field(
        True, description="/metrics needs the API key too (when --api-key is set)"
    )
    responses_store: int = Field(
        256, ge=0, description="responses kept for previous_response_id (0: none)"
    )

    # Images
    vision: bool = Field(
        True,
        description="load the target's vision tower, so prompts may hold images (--no-vision: "
        "text only, less memory)",
    )
    max_images: int = Field(8, ge=0, description="images one request may hold")
    max_image_pixels: int = Field(
        1024 * 1024,
        gt=0,
        description="pixels an image is resized to at most before the vision tower (more: more "
        "image tokens; capped by the model's processor)",
    )
    allow_remote_images: bool = Field(
        False, description="fetch http(s) image URLs (off: images must be sent as data URLs)"
    )
    allowed_image_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="image URL hosts fetched even at a loopback, private, link-local or "
        "metadata address: names, addresses or networks (10.0.0.0/8), comma separated",
    )

    # Engine
    max_queue: int = Field(
        512, ge=0, description="requests that may wait for an active slot (429 beyond)"
    )
    max_active: int | None = Field(
        None,
        ge=1,
        description="requests generating at once (default: the rows a batched pass supports, "
        "measured at load, at least 4; 4 when interleaving)",
    )
    batching: Literal["interleave", "batched"] = Field(
        "batched",
        description="batched: running requests advance in one target pass per round; "
        "interleave: one request's cycle after another",
    )
    max_verify: int | None = Field(
        None, gt=0, description="cap on positions one batched pass verifies (rows x width)"
    )
    context_length: int | None = Field(
        None, gt=0, description="cap on prompt + output tokens (default: the model's)"
    )
    max_kv_memory: str | int | None = Field(
        None,
        description="memory the running requests' caches may reserve (8GB, 512MiB, bytes): a "
        "request waits until its own fits, 503 if it never could (default: 3/4 of what the "
        "weights and the prefix cache leave; 0 or 'none': no budget)",
    )
    prefill_step_size: int = Field(
        512,
        gt=0,
        description="prompt chunk size for prefill: other streams advance between chunks",
    )
    kv_bits: int | None = Field(
        None,
        description="quantize the target's attention KV cache to this many bits "
        f"({', '.join(map(str, KV_BITS))}; as mlx-lm's --kv-bits; default: full precision)",
    )
    kv_group_size: int = Field(
        64, description=f"group size of the KV quantization ({', '.join(map(str, KV_GROUP_SIZES))})"
    )
    quantized_kv_start: int = Field(
        QUANTIZED_KV_START,
        ge=0,
        description="with --kv-bits: quantize a request's KV once it holds this many tokens "
        "(as mlx-lm's --quantized-kv-start)",
    )
    prefix_cache: bool = Field(True, description="reuse earlier prompts' prefilled state")
    prefix_cache_bytes: int | None = Field(
        None, gt=0, description="RAM for the prefix cache (default: 1/8 of the machine's)"
    )
    prefix_cache_dir: str | None = Field(
        None, description="folder for the prefix cache's disk tier (default: no disk tier)"
    )
    prefix_cache_disk_bytes: int = Field(
        16 * 1024**3, gt=0, description="disk space the prefix cache's disk tier may use"
    )
    calibration_cache: str | None = Field(
        None,
        description="folder keeping the costs measured at load per model pair and machine, so a "
        "restart skips measuring (default: ~/.cache/dflash-server/calibration, or under "
        "$XDG_CACHE_HOME; 'off': measure at every start)",
    )
    rank_timeout: float = Field(
        60.0,
        gt=0,
        description="with the target sharded over several machines (mlx.launch): seconds a round "
        "may take before a rank counts as lost (requests get 503, the server exits)",
    )

    # Generation defaults, used when a request leaves the field out
    block_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="draft block size: 'auto' (per cycle, 1..the drafter's, from acceptance and "
        "measured costs) or a fixed 2..the drafter's",
    )
    draft_window: int | None = Field(
        None,
        ge=0,
        description="drafter context: sinks + newest positions its full-attention layers see "
        "(default: the config's sliding_window_size, else 4096; 0: the whole context)",
    )
    speculative: bool = Field(True, description="draft with DFlash (off: plain decoding)")
    suffix_drafts: bool = Field(
        True,
        description="also verify tokens copied from the context and recent outputs when that "
        "pays (block size 'auto', or no drafter)",
    )
    suffix_max_tokens: int = Field(
        32, ge=1, le=256, description="most tokens one suffix copy may verify"
    )
    suffix_cache_bytes: int = Field(
        64 * 1024**2, ge=0, description="memory for the index of recent outputs suffix drafts copy"
    )
    max_tokens: int | None = Field(
        None, gt=0, description="output cap when a request sets none (default: context limit)"
    )
    enable_thinking: bool = Field(True, description="the chat template's thinking switch")
    max_thinking_tokens: int | None = Field(
        None, ge=0, description="reasoning tokens before the answer is forced (default: no cap)"
    )
    # ... and every field of SamplingParams in SERVED_FIELDS, from _SamplingDefaults

    @field_validator("allowed_origins", "allowed_image_hosts", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        # Env vars and flags give one comma-separated string; config files give a list.
        if isinstance(value, str):
            return [o.strip() for o in value.split(",") if o.strip()]
        return value

    @field_validator("allowed_image_hosts")
    @classmethod
    def _check_image_hosts(cls, hosts: list[str]) -> list[str]:
        # A typo'd network would allow nothing, silently: refused at start-up instead.
        for host in hosts:
            if "/" in host:
                try:
                    ipaddress.ip_network(host.strip("[]"), strict=False)
                except ValueError:
                    raise ValueError(f"{host!r} is not a network (like 10.0.0.0/8)") from None
        return hosts

    @field_validator("kv_bits")
    @classmethod
    def _check_kv_bits(cls, value: int | None) -> int | None:
        if value is not None and value not in KV_BITS:
            raise ValueError(f"must be one of {', '.join(map(str, KV_BITS))}, got {value}")
        return value

    @field_validator("kv_group_size")
    @classmethod
    def _check_kv_group(cls, value: int) -> int:
        if value not in KV_GROUP_SIZES:
            raise ValueError(f"must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {value}")
        return value

    @field_validator("max_kv_memory", "max_model_memory", mode="before")
    @classmethod
    def _parse_kv_memory(cls, value: Any, info: ValidationInfo) -> int | None:
        from dflash_server.engine.kv_budget import parse_size

        try:
            return parse_size(value)
        except ValueError as exc:  # the message names the field it was given for
            raise ValueError(str(exc).replace("max_kv_memory", str(info.field_name))) from None

    @model_validator(mode="after")
    def _check_models(self) -> Settings:
        if self.models and (self.target or self.draft):
            raise SettingsError(
                "--models names the models to serve, and --target/--draft name one too: give "
                "either the models file or the one model"
            )
        if self.target is None and self.draft is not None:
            raise SettingsError(
                "--draft was given without --target: pass the target it drafts for, or neither "
                f"to use the default preset ({DEFAULT_PRESET})"
            )
        return self

    @property
    def drafter(self) -> str | None:
        """The drafter to load: a hub id or folder, ``"mtp"``, or None (no drafter)."""
        if self.draft is None or self.draft.lower() == "none":
            return None
        return "mtp" if self.draft.lower() == "mtp" else self.draft

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        cli = getattr(init_settings, "init_kwargs", {})
        config_path = cli.get("config") or os.environ.get("DFLASH_CONFIG")
        paths = [p for p in (_BASE_PRESET.get(), config_path) if p]
        return init_settings, env_settings, ConfigFileSource(settings_cls, paths)

    @classmethod
    def load(cls, **cli: Any) -> Settings:
        """Build settings from CLI values (None = not given) over env, config file, defaults.

        When neither the CLI, the environment nor the config file names a model, the default
        preset provides the models (and its other settings, below everything the user set).
        """
        cli = {k: v for k, v in cli.items() if v is not None}
        config_path = cli.get("config") or os.environ.get("DFLASH_CONFIG")
        file_data = read_config_file(find_config(config_path)) if config_path else {}
        named = any(
            key in cli or f"DFLASH_{key.upper()}" in os.environ or key in file_data
            for key in ("target", "draft", "models")
        )
        token = _BASE_PRESET.set(None if named else DEFAULT_PRESET)
        try:
            return cls(**cli)
        finally:
            _BASE_PRESET.reset(token)

    @property
    def kv_quant(self) -> KVQuant | None:
        """The attention KV quantization every request gets (None: full precision)."""
        return KVQuant.of(self.kv_bits, self.kv_group_size, self.quantized_kv_start)

    @property
    def suffix_tokens(self) -> int:
        """The widest suffix copy a request may verify (0: none)."""
        return self.suffix_max_tokens if self.suffix_drafts else 0

    @property
    def calibration_folder(self) -> Path | None:
        """Where the costs measured at load are kept (None: off)."""
        from dflash_server.engine.calibration import default_folder

        if self.calibration_cache == "off":
            return None
        if self.calibration_cache is None:
            return default_folder()
        return Path(self.calibration_cache).expanduser()

    @property
    def model_memory_bytes(self) -> int | None:
        """The loaded models' budget in bytes (0: none; None: the machine's default)."""
        value = self.max_model_memory
        return value if not isinstance(value, str) else None

    @property
    def kv_memory_bytes(self) -> int | None:
        """The KV budget in bytes (0: none; None: the default, decided once models are loaded)."""
        value = self.max_kv_memory
        return value if not isinstance(value, str) else None  # parsed by the validator

    @property
    def prefix_cache_budget(self) -> int:
        """The prefix cache's RAM budget in bytes (0: off)."""
        if not self.prefix_cache:
            return 0
        if self.prefix_cache_bytes is not None:
            return self.prefix_cache_bytes
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - exotic platforms
            memory = 16 * 1024**3
        return memory // 8

    @property
    def model_id(self) -> str:
        """The id served on /v1/models and accepted in the ``model`` field."""
        if self.served_model_name:
            return self.served_model_name
        return Path(str(self.target).rstrip("/")).name or str(self.target)
