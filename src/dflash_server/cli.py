"""``dflash-serve``: resolve settings, fetch the models, run the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from dflash_server.engine.loader import (
    DRAFT_PATTERNS,
    TARGET_PATTERNS,
    ModelLoadError,
    resolve_model,
)
from dflash_server.settings import DEFAULT_PRESET, Settings, SettingsError, list_presets

log = logging.getLogger("dflash_server")


def build_parser() -> argparse.ArgumentParser:
    """Every flag defaults to None (= not given) so lower settings layers can fill it."""
    p = argparse.ArgumentParser(
        prog="dflash-serve",
        description="OpenAI-compatible server for DFlash speculative decoding on MLX. "
        "Flags override DFLASH_* environment variables, which override --config.",
        epilog="Drafter tools: 'dflash-serve convert --help', 'dflash-serve train --help'.",
        argument_default=None,
    )
    m = p.add_argument_group("models")
    m.add_argument("--target", help="target model: HF repo id or local MLX folder")
    m.add_argument("--draft", help="DFlash drafter: HF repo id or local folder")
    m.add_argument(
        "--config",
        help=f"TOML/JSON settings file, or a preset name ({', '.join(list_presets())}); "
        f"with no model anywhere the '{DEFAULT_PRESET}' preset is used",
    )
    m.add_argument("--served-model-name", help="model id for clients (default: --target's name)")
    m.add_argument("--context-length", type=int, help="cap prompt+output tokens (default: model's)")

    h = p.add_argument_group("HTTP")
    h.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 exposes the server)")
    h.add_argument("--port", type=int, help="port (default 8000)")
    h.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on /v1/*")
    h.add_argument("--allowed-origins", help="CORS origins, comma separated, or '*'")
    h.add_argument("--keepalive", type=float, help="seconds between SSE keepalive comments")
    h.add_argument(
        "--stream-interval",
        type=float,
        help="min seconds between streamed text events; faster tokens go out together (0.02)",
    )
    h.add_argument("--max-request-bytes", type=int, help="largest request body (4 MiB); 413 beyond")
    h.add_argument(
        "--shutdown-timeout",
        type=float,
        help="seconds in-flight requests may finish on SIGINT/SIGTERM before they are ended (5)",
    )
    h.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log level (only 'debug' logs prompt text)",
    )

    e = p.add_argument_group("engine")
    e.add_argument("--max-queue", type=int, help="requests waiting for an active slot (8)")
    e.add_argument(
        "--max-active", type=int, help="requests generating at once, one cycle each in turn (4)"
    )
    e.add_argument("--prefill-step-size", type=int, help="prompt chunk size for prefill (2048)")

    g = p.add_argument_group("generation defaults (requests override them)")
    g.add_argument("--block-size", type=int, help="draft block size (default: the drafter's)")
    g.add_argument(
        "--speculative",
        action=argparse.BooleanOptionalAction,
        help="use the drafter (--no-speculative: plain decoding)",
    )
    g.add_argument("--max-tokens", type=int, help="output cap (default: up to the context limit)")
    g.add_argument(
        "--enable-thinking",
        action=argparse.BooleanOptionalAction,
        help="thinking on by default (--no-enable-thinking turns it off)",
    )
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--min-p", type=float)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--frequency-penalty", type=float)
    return p


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    """Parse flags and merge the settings layers; raise SettingsError with one clear line."""
    args = vars(build_parser().parse_args(argv))
    try:
        return Settings.load(**args)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        flag = f"--{field.replace('_', '-')}: " if field else ""
        raise SettingsError(f"{flag}{msg}") from None


def _uvicorn_log_config(level: str) -> dict[str, Any]:
    from uvicorn.config import LOGGING_CONFIG

    config = {**LOGGING_CONFIG, "loggers": dict(LOGGING_CONFIG["loggers"])}
    config["loggers"]["dflash_server"] = {
        "handlers": ["default"],
        "level": level.upper(),
        "propagate": False,
    }
    return config


# Drafter tools, dispatched before the server's flags are parsed: ``dflash-serve train ...``.
TOOLS = {"convert": "dflash_server.tools.convert", "train": "dflash_server.tools.train"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dflash-serve``; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in TOOLS:
        import importlib

        return importlib.import_module(TOOLS[args[0]]).main(args[1:])
    try:
        settings = load_settings(argv)
    except SettingsError as exc:
        print(f"dflash-serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:  %(message)s")
    try:
        # Download before the server starts: progress bars go to the console and a bad id
        # fails here, in one line, instead of inside a running server.
        target_path = resolve_model(str(settings.target), "target", TARGET_PATTERNS)
        draft_path = resolve_model(str(settings.draft), "draft", DRAFT_PATTERNS)
    except ModelLoadError as exc:
        print(f"dflash-serve: error: {exc}", file=sys.stderr)
        return 1
    return serve(settings, str(target_path), str(draft_path))


def serve(settings: Settings, target_path: str, draft_path: str) -> int:
    """Run uvicorn until shutdown; the engine loads the models on its worker meanwhile."""
    import uvicorn

    from dflash_server.api.app import build_engine, create_app
    from dflash_server.api.shutdown import GracefulServer

    failure: list[str] = []
    server: GracefulServer | None = None

    def on_fatal(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    engine = build_engine(
        settings, target_path=target_path, draft_path=draft_path, on_fatal=on_fatal
    )
    app = create_app(settings, engine)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=_uvicorn_log_config(settings.log_level),
        log_level=settings.log_level,
        # After the engine's grace period every stream has its final event; this is a backstop.
        timeout_graceful_shutdown=int(settings.shutdown_timeout) + 10,
    )
    server = GracefulServer(config, engine, settings.shutdown_timeout)
    log.info("loading %s + %s", settings.target, settings.draft)
    # uvicorn re-raises Ctrl-C after its graceful shutdown; that is a normal exit here.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if failure:
        print(f"dflash-serve: error: {failure[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
