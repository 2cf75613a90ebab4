"""``dflash-serve``: resolve settings, fetch the models, run the OpenAI-compatible server."""

from __future__ import annotations

import os
import signal
import sys

# Everything else is imported where a command needs it: --version and every --help answer at
# once, and Ctrl-C finds main() running from the first moment it can.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence
    from typing import Any

    from pydantic.fields import FieldInfo

    from dflash_server.settings import Settings

INTERRUPTED = 130  # the shell's status for a process ended by Ctrl-C (128 + SIGINT)


# Help sections: each starts at the named field and runs until the next (Settings' order).
_SECTIONS = {
    "target": "models",
    "host": "HTTP",
    "max_queue": "engine",
    "block_size": "generation defaults (requests override them)",
}
SUBCOMMANDS = {
    "convert": ("dflash_server.tools.convert", "convert a drafter checkpoint (e.g. quantize it)"),
    "train": ("dflash_server.tools.train", "train or fine-tune a drafter on your target"),
    "export": ("dflash_server.tools.export", "print the vLLM/SGLang command for a GPU server"),
    "bench": ("dflash_server.tools.bench", "plain vs DFlash (fixed, auto) on this machine"),
    "models": ("dflash_server.tools.models", "list the hub models in the local cache"),
}

# The subcommands whose modules import MLX at their top keep their flags in a light module.
LIGHT_PARSERS = {
    "convert": "dflash_server.tools.convert_args",
    "train": "dflash_server.tools.train_args",
}


def settings_fields() -> list[tuple[str, FieldInfo]]:
    """Settings' fields in help order: its own sections, the sampling defaults last."""
    from dflash_server.settings import Settings

    own = [n for n in Settings.__annotations__ if n in Settings.model_fields]
    rest = [n for n in Settings.model_fields if n not in own]
    return [(n, Settings.model_fields[n]) for n in own + rest]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default(info: FieldInfo) -> str | None:
    value = info.get_default(call_default_factory=True)
    if value is None or value == []:
        return None
    return str(value).lower() if isinstance(value, bool) else str(value)


def _add_flag(group: argparse._ArgumentGroup, name: str, info: FieldInfo) -> None:
    """One flag from one field: its type, choices and help, all read from the field."""
    import argparse
    from types import UnionType
    from typing import Literal, Union, get_args, get_origin

    kind = info.annotation
    optional = get_origin(kind) in (Union, UnionType)
    args = [a for a in get_args(kind) if a is not type(None)] if optional else [kind]
    help_text = info.description or name.replace("_", " ")
    if name == "config":
        from dflash_server.config_files import list_presets

        help_text += f" ({', '.join(list_presets())})"
    if (default := _default(info)) is not None:
        help_text += f" (default: {default})"
    words = [w for a in args if get_origin(a) is Literal for w in get_args(a)]
    if args[0] is bool:
        group.add_argument(_flag(name), action=argparse.BooleanOptionalAction, help=help_text)
    elif words and len(args) > 1:  # a number or a word ("auto")
        group.add_argument(_flag(name), type=_number_or(words), metavar="N|" + "|".join(words),
                           help=help_text)  # fmt: skip
    elif get_origin(args[0]) is Literal:
        group.add_argument(_flag(name), choices=list(get_args(args[0])), help=help_text)
    else:
        scalar = float if args[0] is float else int if args[0] is int else str  # lists: "a,b"
        group.add_argument(_flag(name), type=scalar, help=help_text)


def _number_or(words: list[str]) -> Any:
    import argparse

    def parse(text: str) -> int | str:
        if text in words:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number or {', '.join(map(repr, words))}, got {text!r}"
            ) from None

    return parse


def _subcommands() -> str:
    tools = "\n".join(f"  {name:<9} {text}" for name, (_, text) in SUBCOMMANDS.items())
    return f"subcommands (dflash-serve NAME --help):\n{tools}"


def build_parser() -> argparse.ArgumentParser:
    """Flags generated from Settings; every one defaults to None (= not given) so lower
    settings layers can fill it."""
    import argparse

    from dflash_server.cli_parser import Parser
    from dflash_server.config_files import DEFAULT_PRESET

    p = Parser(
        prog="dflash-serve",
        description="OpenAI-compatible server for DFlash speculative decoding on MLX. "
        "Flags override DFLASH_* environment variables, which override --config; with no model "
        f"named anywhere the '{DEFAULT_PRESET}' preset is used. "
        "dflash-serve --version prints the version.",
        epilog=_subcommands(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=None,
    )
    group = p.add_argument_group("settings")
    for name, info in settings_fields():
        if name in _SECTIONS:
            group = p.add_argument_group(_SECTIONS[name])
        _add_flag(group, name, info)
    return p


def markdown_table() -> str:
    """The README's CLI reference table, generated from the same fields as the flags."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for name, info in settings_fields():
        flag = f"`{_flag(name)}`"
        if info.annotation is bool:
            flag = f"`{_flag(name)}` / `--no-{name.replace('_', '-')}`"
        default = _default(info)
        rows.append(f"| {flag} | {f'`{default}`' if default else '-'} | {info.description} |")
    return "\n".join(rows)


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    """Parse flags and merge the settings layers; raise SettingsError with one clear line."""
    from pydantic import ValidationError

    from dflash_server.config_files import SettingsError
    from dflash_server.settings import Settings

    args = vars(build_parser().parse_args(argv))
    try:
        return Settings.load(**args)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        where = f"{_source(field, args)}: " if field else ""
        raise SettingsError(f"{where}{msg}") from None


def _source(field: str, args: dict[str, Any]) -> str:
    """Where a setting's value came from, as the user wrote it: flag, variable or config key."""
    variable = f"DFLASH_{field.upper()}"
    config = args.get("config") or os.environ.get("DFLASH_CONFIG")
    if args.get(field) is None and variable in os.environ:
        return f"{variable}={os.environ[variable]!r}"
    if args.get(field) is None and config:
        return f"{field!r} in {config}"
    return _flag(field)


def listen_error(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port`` (found by binding it now, before minutes
    of loading), or None."""
    import errno
    import socket

    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"--host {host!r}: {exc.strerror}"
    for family, kind, proto, _, address in addresses:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # a family this machine lacks (IPv6 off): uvicorn skips it too
            continue
        with sock:
            # Bound as asyncio binds uvicorn's sockets, so the test fails exactly when it would.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return (
                        f"port {port} on {host} is already in use (another dflash-serve?): stop "
                        "that server, or choose another port with --port"
                    )
                return f"cannot listen on {host}:{port}: {exc.strerror} (check --host)"
    return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dflash-server")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree, not installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dflash-serve``; returns the process exit code. Ctrl-C while importing,
    reading settings or downloading ends it with 130 and one line (the server's own run
    handles it from there: ``serve/server.py``)."""
    if argv is None:  # the command itself, not a caller's test of main()
        signal.signal(signal.SIGINT, _interrupted)
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("dflash-serve: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED


def _interrupted(signum: int, frame: object) -> None:
    """Ctrl-C before the server runs (uvicorn installs its own handler meanwhile): one line and
    130 at once. A KeyboardInterrupt can be lost inside a library's import, and an interpreter
    shutdown waits for threads the imports started; ending here depends on neither."""
    os.write(2, b"dflash-serve: interrupted (Ctrl-C)\n")
    os._exit(INTERRUPTED)


def _main(args: list[str]) -> int:
    if args and args[0] in SUBCOMMANDS:  # dispatched before the server's flags are parsed
        return _subcommand(args[0], args[1:])
    if args and not args[0].startswith("-"):  # the server takes no positional arguments
        from dflash_server.cli_parser import did_you_mean

        guess = did_you_mean(args[0], SUBCOMMANDS)
        print(f"dflash-serve: error: no subcommand {args[0]!r}{guess}", file=sys.stderr)
        print(_subcommands(), file=sys.stderr)
        return 2
    if "--version" in args:
        print(f"dflash-serve {_version()}")
        return 0
    from dflash_server.config_files import SettingsError

    try:
        settings = load_settings(args)
    except SettingsError as exc:
        print(f"dflash-serve: error: {exc}", file=sys.stderr)
        return 2
    return _start(settings)


def _subcommand(name: str, argv: list[str]) -> int:
    """Run a subcommand; its flags parsed first from a module that imports nothing heavy when
    the command's own imports take seconds (--help and a mistyped flag answer at once)."""
    from importlib import import_module

    if (flags := LIGHT_PARSERS.get(name)) is not None:
        import_module(flags).build_parser().parse_args(argv)
    return int(import_module(SUBCOMMANDS[name][0]).main(argv))


def _start(settings: Settings) -> int:
    """Check what can be checked before loading (the port, the models' files, the flags against
    the target's config), then serve (rank 0) or follow rank 0."""
    import logging

    from dflash_server.engine.distributed import world
    from dflash_server.engine.loader import (
        TARGET_PATTERNS,
        ModelLoadError,
        resolve_draft,
        resolve_model,
    )
    from dflash_server.serve.preflight import refusal

    group = world()  # launched by mlx.launch over several processes: rank 0 serves HTTP
    rank = 0 if group is None else group.rank()
    if settings.models and group is not None:
        print(
            f"dflash-serve: error: rank {rank}: --models serves several models on one machine; "
            "over several ranks (mlx.launch) serve one model with --target and --draft",
            file=sys.stderr,
        )
        return 2
    if rank == 0 and (problem := listen_error(settings.host, settings.port)) is not None:
        print(f"dflash-serve: error: {problem}", file=sys.stderr)
        return 1
    who = "" if group is None else f"rank {rank}: "
    logging.basicConfig(
        level=settings.log_level.upper(), format=f"%(levelname)s:  {who}%(message)s"
    )
    if settings.models:
        return _serve_models(settings)
    try:
        # Download before the server starts: progress bars go to the console and a bad id
        # fails here, in one line, instead of inside a running server.
        target_path = resolve_model(str(settings.target), "target", TARGET_PATTERNS)
        draft_path = resolve_draft(settings.drafter)
    except ModelLoadError as exc:
        print(f"dflash-serve: error: {exc}", file=sys.stderr)
        return 1
    if (problem := refusal(settings, target_path)) is not None:
        print(f"dflash-serve: error: {problem}", file=sys.stderr)
        return 2
    if group is not None:
        from dflash_server.serve import ranks

        if (problem := ranks.refusal(settings, group, str(target_path), draft_path)) is not None:
            print(f"dflash-serve: error: {who}{problem}", file=sys.stderr)
            return 2
        if rank > 0:
            return ranks.follow(settings, str(target_path), draft_path, group)
    from dflash_server.serve.server import serve

    return serve(settings, str(target_path), draft_path, group)


def _serve_models(settings: Settings) -> int:
    """Serve a models file's models (read and checked now; each loads when asked for)."""
    from dflash_server.config_files import SettingsError
    from dflash_server.models_file import read_models_file
    from dflash_server.serve.server import serve

    try:
        entries = read_models_file(str(settings.models), settings)
    except SettingsError as exc:
        print(f"dflash-serve: error: {exc}", file=sys.stderr)
        return 2
    return serve(settings, None, None, entries=entries)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
