"""``dflash-serve export vllm|sglang|mlx``: the same model, drafter and defaults elsewhere.

For a GPU server it prints the launch command the DFlash model cards give for vLLM and SGLang,
filled in from a preset (or ``--target``/``--draft``) and the usual settings layers: the
original Hugging Face checkpoint instead of the MLX conversion (the preset's ``hf_target``), the
drafter and its block size, served model name, context length, API key, host/port and sampling
defaults. ``--compose FILE`` also writes a docker-compose file that runs it. For several Macs
(``mlx``, with ``--hosts`` or ``--hostfile``) it prints the ``mlx.launch`` command that runs
this server on each of them, the target sharded over them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dflash_server.cli_parser import Parser
from dflash_server.config_files import SettingsError
from dflash_server.settings import Settings

# What the model cards use for the z-lab Qwen3.5 drafters (all trained with 16-token blocks).
MTP_BLOCK_SIZE = 4  # the anchor and 3 drafts: what the peers run Qwen3.5 MTP with
CARD_BLOCK_SIZE = 16
IMAGES = {"vllm": "vllm/vllm-openai:latest", "sglang": "lmsysorg/sglang:latest"}
NEUTRAL = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
# vLLM reads only these defaults from a generation config (--override-generation-config).
VLLM_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dflash-serve export",
        description="Print the vLLM or SGLang command that serves the same target, DFlash "
        "drafter and defaults on a GPU server (settings layers as for dflash-serve).",
    )
    p.add_argument("engine", choices=["vllm", "sglang", "mlx"])
    p.add_argument("--config", help="preset name or TOML/JSON settings file")
    p.add_argument("--target", help="target model (hub id); give --draft too")
    p.add_argument("--draft", help="DFlash drafter (hub id or folder)")
    p.add_argument("--hf-target", help="original HF checkpoint of the target (default: preset's)")
    p.add_argument("--block-size", type=int, help="draft block size (default: the drafter's)")
    p.add_argument("--tensor-parallel", type=int, default=1, help="GPUs to split the model over")
    p.add_argument("--served-model-name", help="model id for clients (default: as dflash-serve)")
    p.add_argument("--context-length", type=int, help="prompt + output token limit")
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>'")
    p.add_argument("--host", help="bind address (default: as dflash-serve)")
    p.add_argument("--port", type=int, help="port (default: as dflash-serve)")
    p.add_argument("--compose", metavar="FILE", help="also write a docker-compose file")
    p.add_argument("--hosts", help="mlx: the Macs' IP addresses, comma separated (ring backend)")
    p.add_argument("--hostfile", help="mlx: MLX's JSON hostfile (mlx.distributed_config writes it)")
    p.add_argument("--backend", choices=["ring", "jaccl", "jaccl-ring"], help="mlx: the transport")
    return p


def mlx_launch(args: argparse.Namespace, settings: Settings) -> Export:
    """``mlx.launch`` over several Macs, the same ``dflash-serve`` on each: the target sharded
    over them, the first serving HTTP (docs/operations.md, "Two Macs")."""
    if bool(args.hosts) == bool(args.hostfile):
        raise SettingsError("export mlx needs --hosts IP1,IP2 or --hostfile FILE (one of them)")
    if args.hosts and args.backend in ("jaccl", "jaccl-ring"):
        raise SettingsError(
            "JACCL needs a hostfile naming each Mac's RDMA devices: write one with "
            "'mlx.distributed_config --backend jaccl --over thunderbolt --hosts mac1,mac2 "
            "--auto-setup --output hosts.json', then pass --hostfile hosts.json"
        )
    if args.hosts and not all(_is_ip(h) for h in args.hosts.split(",")):
        raise SettingsError(
            f"--hosts {args.hosts}: the ring backend connects to IP addresses; give them, or "
            "a hostfile (mlx.distributed_config --backend ring --over ethernet writes one)"
        )
    launch = [_script("mlx.launch"), *(["--hostfile", args.hostfile] if args.hostfile else [])]
    launch += ["--hosts", args.hosts] if args.hosts else []
    launch += ["--backend", args.backend or "ring"] if args.hosts or args.backend else []
    given = {
        "--config": args.config,
        "--target": args.target,
        "--draft": args.draft,
        "--served-model-name": args.served_model_name,
        "--context-length": args.context_length,
        "--block-size": args.block_size,
        "--api-key": args.api_key,
        "--host": settings.host,
        "--port": settings.port,
    }
    serve = [w for flag, v in given.items() if v is not None for w in (flag, str(v))]
    notes = [
        "every Mac needs the same dflash-server, MLX and mlx-lm and the same model files (a hub "
        "id, or a folder at the same path): the ranks compare them at start",
        "the first host is rank 0: it serves HTTP",
    ]
    if settings.host in ("127.0.0.1", "localhost", "::1"):
        notes.append("only clients on the first Mac reach it: --host 0.0.0.0 exposes it")
    notes.append(
        "mlx.launch exits 0 even when a Mac's command failed: it worked when rank 0 logs "
        "'ready: serving' (or GET /health says \"ready\")"
    )
    # '--' ends mlx.launch's own flags: its --hosts would swallow dflash-serve's --host.
    return Export("mlx", [*launch, "--", _script("dflash-serve"), *serve], notes)


def _script(name: str) -> str:
    """The full path of a command installed beside this Python (the clone's .venv/bin): each
    Mac runs it over a non-interactive ssh, whose PATH has no virtual environment on it."""
    path = Path(sys.executable).parent / name
    return str(path) if path.is_file() else name


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def resolve_hf_target(settings: Settings, explicit: str | None, target_given: bool) -> str:
    """The checkpoint a GPU server loads: --hf-target, else the preset's, else the target id."""
    if explicit:
        return explicit
    if settings.hf_target and not target_given:  # a preset's mapping, for the preset's target
        return settings.hf_target
    target = str(settings.target)
    if Path(target).expanduser().exists():
        raise SettingsError(
            f"--target {target} is a local MLX folder; vLLM and SGLang load Hugging Face "
            "checkpoints: pass --hf-target ORG/NAME (the model it was converted from)"
        )
    return target


def drafter_block_size(draft: str) -> int | None:
    """The drafter's trained block size from its config.json, if it is on disk (no download)."""
    folder = Path(draft).expanduser()
    path: Any = folder / "config.json" if folder.is_dir() else None
    if path is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(draft, "config.json")
        except Exception:
            path = None
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        return None
    config = json.loads(Path(path).read_text())
    size = config.get("block_size") or config.get("dflash_config", {}).get("block_size")
    return int(size) if size else None


def sampling_defaults(settings: Settings) -> dict[str, Any]:
    """Temperature plus every sampling default that is not neutral, by OpenAI/HF names."""
    out: dict[str, Any] = {"temperature": getattr(settings, "temperature")}  # noqa: B009
    for name, neutral in NEUTRAL.items():
        value = getattr(settings, name, None)
        if value is not None and value != neutral:
            out[name] = value
    return out


def qwen_family(model_id: str) -> str | None:
    """'hybrid' for Qwen3.5/3.6 (Gated DeltaNet), 'qwen3' for other Qwen3, else None."""
    if re.search(r"qwen3\.[5-9]", model_id, re.IGNORECASE):
        return "hybrid"
    return "qwen3" if re.search(r"qwen3", model_id, re.IGNORECASE) else None


class Export:
    """A launch command plus notes; prints as a shell snippet or a docker-compose file."""

    def __init__(self, engine: str, argv: list[str], notes: list[str]) -> None:
        self.engine, self.argv, self.notes = engine, argv, notes

    def shell(self) -> str:
        lines = [f"# {note}" for note in self.notes]
        # One flag (with its value) per line, as the model cards write them.
        words = [shlex.quote(w) for w in self.argv]
        parts = [" ".join(words[:3])]  # 'vllm serve MODEL' / 'python -m sglang.launch_server'
        for w in words[3:]:
            if w.startswith("--"):
                parts.append(w)
            else:
                parts[-1] += f" {w}"
        return "\n".join([*lines, " \\\n  ".join(parts)]) + "\n"

    def compose(self) -> str:
        """A docker-compose file running the same command in the engine's official image."""
        args = list(self.argv)
        host_i = args.index("--host") + 1
        port = args[args.index("--port") + 1]
        bind = "" if args[host_i] in {"0.0.0.0", "::"} else f"{args[host_i]}:"
        args[host_i] = "0.0.0.0"  # inside the container; the port mapping decides exposure
        if self.engine == "vllm":  # the image's entrypoint is the vLLM server itself
            command = ["--model", args[2], *args[3:]]
        else:
            command = ["python3", *args[1:]]

        def q(value: str) -> str:  # JSON strings are YAML strings; $ is compose interpolation
            return json.dumps(value).replace("$", "$$")

        lines = [f"# {note}" for note in self.notes] + [
            "# written by 'dflash-serve export'; start with: docker compose up",
            "services:",
            f"  {self.engine}:",
            f"    image: {q(IMAGES[self.engine])}",
            "    ipc: host",
            f"    ports: [{q(f'{bind}{port}:{port}')}]",
            '    volumes: ["${HOME}/.cache/huggingface:/root/.cache/huggingface"]',
            '    environment: ["HF_TOKEN=${HF_TOKEN:-}"]',
            "    command:",
            *[f"      - {q(a)}" for a in command],
            "    deploy:",
            "      resources:",
            "        reservations:",
            "          devices:",
            "            - driver: nvidia",
            "              count: all",
            "              capabilities: [gpu]",
        ]
        return "\n".join(lines) + "\n"


def export(
    engine: str, settings: Settings, hf_target: str, block: int, tp: int, notes: list[str]
) -> Export:
    """The launch command for ``engine``; ``notes`` (printed above it as comments) grow."""
    defaults = sampling_defaults(settings)
    family = qwen_family(hf_target)
    if engine == "vllm":
        argv = ["vllm", "serve", hf_target, "--served-model-name", settings.model_id]
        spec: dict[str, Any] | None = None
        if settings.drafter == "mtp":  # the target's own head: vLLM's "mtp" method
            spec = {"method": "mtp", "num_speculative_tokens": block - 1}
        elif settings.drafter is not None:
            spec = {"method": "dflash", "model": settings.drafter}
            spec["num_speculative_tokens"] = block - 1
        if spec is not None:
            argv += ["--speculative-config", json.dumps(spec)]
        argv += ["--attention-backend", "flash_attn", "--max-num-batched-tokens", "32768"]
        argv += ["--tensor-parallel-size", str(tp)]
        if settings.context_length:
            argv += ["--max-model-len", str(settings.context_length)]
        if family:
            argv += ["--reasoning-parser", "qwen3"]
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
        generation = {k: v for k, v in defaults.items() if k in VLLM_GENERATION_KEYS}
        if settings.max_tokens:
            generation["max_new_tokens"] = settings.max_tokens
        argv += ["--override-generation-config", json.dumps(generation)]
        if not settings.enable_thinking:
            argv += ["--default-chat-template-kwargs", json.dumps({"enable_thinking": False})]
        per_request = {k: v for k, v in defaults.items() if k not in VLLM_GENERATION_KEYS}
        if per_request:
            notes.append(
                "vLLM takes no server default for "
                + ", ".join(f"{k}={v}" for k, v in per_request.items())
                + ": send it per request"
            )
        if spec is not None and spec["method"] == "dflash":
            notes.append("DFlash needs a recent vLLM (the model cards used a nightly build)")
    else:
        argv = ["python", "-m", "sglang.launch_server", "--model-path", hf_target]
        argv += ["--served-model-name", settings.model_id]
        if settings.drafter == "mtp":  # SGLang runs a checkpoint's own head as NEXTN
            argv += ["--speculative-algorithm", "NEXTN", "--speculative-num-steps"]
            argv += [str(block - 1), "--speculative-eagle-topk", "1"]
            argv += ["--speculative-num-draft-tokens", str(block)]
        elif settings.drafter is not None:
            argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path"]
            argv += [settings.drafter, "--speculative-num-draft-tokens", str(block)]
        argv += ["--tp-size", str(tp), "--attention-backend", "fa3"]
        argv += ["--mem-fraction-static", "0.75"]
        if family == "hybrid":
            argv += ["--mamba-scheduler-strategy", "extra_buffer"]
        argv += ["--trust-remote-code"]
        if settings.context_length:
            argv += ["--context-length", str(settings.context_length)]
        if family:
            argv += ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder"]
        argv += ["--sampling-defaults", "model"]
        notes.append(
            "SGLang takes default sampling from the checkpoint's generation_config.json; "
            "these are dflash-serve's, send them per request where they differ: "
            + ", ".join(f"{k}={v}" for k, v in defaults.items())
        )
        if not settings.enable_thinking:
            notes.append(
                'thinking is off here: send "chat_template_kwargs": '
                '{"enable_thinking": false} per request'
            )
        if settings.drafter not in (None, "mtp"):
            notes.append("DFlash needs a recent SGLang (the model cards used a development build)")
    if family is None:
        notes.append("add the reasoning and tool-call parsers for your model family")
    argv += ["--host", settings.host, "--port", str(settings.port)]
    if settings.api_key:
        argv += ["--api-key", settings.api_key]
    return Export(engine, argv, notes)


def load(args: argparse.Namespace) -> Settings:
    cli = {
        "config": args.config,
        "target": args.target,
        "draft": args.draft,
        "served_model_name": args.served_model_name,
        "context_length": args.context_length,
        "api_key": args.api_key,
        "host": args.host,
        "port": args.port,
        "block_size": args.block_size,
    }
    try:
        return Settings.load(**cli)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise SettingsError(msg) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load(args)
        if args.engine == "mlx":
            if args.compose:
                raise SettingsError("--compose writes a docker-compose file for vLLM or SGLang")
            print(mlx_launch(args, settings).shell(), end="")
            return 0
        if args.hosts or args.hostfile or args.backend:
            raise SettingsError("--hosts, --hostfile and --backend are for 'export mlx'")
        hf_target = resolve_hf_target(settings, args.hf_target, args.target is not None)
    except SettingsError as exc:
        print(f"dflash-serve export: error: {exc}", file=sys.stderr)
        return 2
    notes: list[str] = []
    fixed = settings.block_size if isinstance(settings.block_size, int) else None  # not "auto"
    drafter = settings.drafter
    if drafter == "mtp" and fixed is None:
        fixed = MTP_BLOCK_SIZE
        notes.append(f"MTP verifies {MTP_BLOCK_SIZE} positions per step: --block-size changes it")
    block = fixed or (drafter_block_size(drafter) if drafter and drafter != "mtp" else None)
    if block is None:
        block = CARD_BLOCK_SIZE
        notes.append(
            f"block size {block} assumed (the model cards' value; the drafter's config.json "
            "is not on this machine): pass --block-size to change it"
        )
    result = export(args.engine, settings, hf_target, block, args.tensor_parallel, notes)
    print(result.shell(), end="")
    if args.compose:
        path = Path(args.compose)
        path.write_text(result.compose())
        if settings.api_key:  # the file holds the key
            os.chmod(path, 0o600)
        print(f"# wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
