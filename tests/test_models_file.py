"""``--models FILE``: entries, per-model settings, and every refusal as one line naming the
entry and the fix; a models file is refused over several ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_server.config_files import SettingsError
from dflash_server.models_file import read_models_file
from dflash_server.settings import Settings

GOOD = """
[[models]]
id = "big"
target = "owner/big"
draft = "owner/big-dflash"
aliases = ["gpt-4o", "default"]
kv_bits = 8
temperature = 0.6
ttl = 600

[[models]]
preset = "qwen3.5-4b"
context_length = 4096

[[models]]
id = "embed"
kind = "embeddings"
target = "Qwen/Qwen3-Embedding-0.6B"
pinned = true
"""


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


def test_entries_get_their_own_settings_over_the_servers(tmp_path: Path) -> None:
    server = Settings.load(models=str(_file(tmp_path, GOOD)), temperature=0.9, model_ttl=30)
    big, preset, embed = read_models_file(str(server.models), server)
    assert (big.id, big.aliases, big.kind, big.ttl, big.pinned) == (
        "big", ("gpt-4o", "default"), "chat", 600, False,
    )  # fmt: skip
    assert big.settings.kv_bits == 8 and big.settings.temperature == 0.6
    assert big.settings.target == "owner/big" and big.settings.model_id == "big"
    assert big.settings.models is None  # an entry's settings name its one model
    # A preset gives the id (its served name), target, drafter and defaults; the entry wins.
    assert preset.id == "qwen3.5-4b" and preset.settings.context_length == 4096
    assert preset.settings.draft and preset.ttl == 30  # the server's --model-ttl
    assert preset.settings.temperature == 1.0  # the preset's own, over the server's 0.9
    assert (embed.kind, embed.pinned, embed.settings.drafter) == ("embeddings", True, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[models]]\ntarget = "x"', "give it an id"),
        ('[[models]]\nid = "a"', "give it a 'target'"),
        ('[[models]]\nid = "a"\ntarget = "x"\nkv_bit = 8', "unknown key(s) 'kv_bit' (did you mean 'kv_bits'?)"),
        ('[[models]]\nid = "a"\ntarget = "x"\nkind = "vision"', "kind must be one of chat, embeddings"),
        ('[[models]]\nid = "a"\ntarget = "x"\nkind = "embeddings"\ndraft = "d"', "takes no 'draft'"),
        ('[[models]]\nid = "a"\ntarget = "x"\nttl = 0', "ttl must be a number of seconds"),
        ('[[models]]\nid = "a"\ntarget = "x"\npinned = "yes"', "pinned must be true or false"),
        ('[[models]]\nid = "a"\ntarget = "x"\nkv_bits = 7', "kv_bits: must be one of"),
        ('[[models]]\nid = "a"\ntarget = "x"\naliases = "b"', "aliases must be a list"),
        ('[[models]]\nid = "a"\ntarget = "x"\n[[models]]\nid = "b"\ntarget = "y"\naliases = ["a"]',
         "'a' names both 'a' and 'b'"),
        ('target = "x"', "only [[models]] tables belong here"),
        ("", "no [[models]] tables"),
        ("[[models]\n", "cannot read the models file"),
    ],
)  # fmt: skip
def test_refusals_name_the_entry_and_the_fix(tmp_path: Path, text: str, message: str) -> None:
    path = _file(tmp_path, text)
    server = Settings.load(models=str(path))
    with pytest.raises(SettingsError, match=None) as caught:
        read_models_file(str(path), server)
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_models_and_target_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="either the models file or the one model"):
        Settings.load(models=str(_file(tmp_path, GOOD)), target="owner/x")


def test_a_models_file_over_several_ranks_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dflash_server import cli
    from dflash_server.engine import distributed

    class Group:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 2

    monkeypatch.setattr(distributed, "world", lambda: Group())
    assert cli.main(["--models", str(_file(tmp_path, GOOD))]) == 2
    err = capsys.readouterr().err
    assert "--models serves several models on one machine" in err and "--target" in err


def test_a_bad_models_file_stops_the_server_before_it_listens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dflash_server import cli

    path = _file(tmp_path, '[[models]]\nid = "a"')
    assert cli.main(["--models", str(path), "--port", "0"]) == 2
    assert "give it a 'target'" in capsys.readouterr().err
