"""``dflash-serve bench``: table and JSON on a tiny pair, every mode, the drafter family."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from dflash_server.cli import main
from dflash_server.tools.bench import Run, summarize, verdict


@pytest.fixture(scope="module")
def pair(tiny_hybrid_path: Path, draft_path: Path) -> list[str]:
    return ["--target", str(tiny_hybrid_path), "--draft", str(draft_path)]


def test_bench_json(pair: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", *pair, "--max-tokens", "12", "--modes", "plain,4,auto", "--json"]
    assert main([*argv, "--prompt", "def add(a, b):"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["draft_family"] == "DFlash" and result["draft_window"] == 4096
    assert result["prompts"] == ["code", "math", "chat", "own1"]
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"plain", "4", "auto"}
    assert rows["plain"]["speedup"] == pytest.approx(1.0) and rows["plain"]["plain_share"] == 1
    assert set(rows["4"]["block_sizes"]) <= {"1", "2", "3", "4"} and rows["4"]["tau"] >= 1
    assert rows["auto"]["tokens_per_s"] > 0 and result["split_ms"]["4"]["verify"] > 0
    assert result["verdict"]


def test_bench_table(pair: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps("x = 1") + "\n")
    argv = ["bench", *pair, "--max-tokens", "8", "--no-builtin", "--prompts", str(prompts)]
    assert main([*argv, "--modes", "plain,auto"]) == 0
    out = capsys.readouterr().out
    assert "mode | tok/s | vs plain | tau" in out and "\nauto | " in out
    assert "DFlash drafter" in out and ("best:" in out or "does not pay" in out)


def test_bench_bad_modes(pair: list[str]) -> None:
    with pytest.raises(SystemExit, match="unknown mode"):
        main(["bench", *pair, "--modes", "plain,fast"])


def test_bench_concurrency(pair: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """N clients at once through the server's engine: a row per client count and mode, the
    batched passes holding several rows."""
    argv = ["bench", *pair, "--max-tokens", "8", "--concurrency", "1,3", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(r["clients"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(1, "plain"), (1, "auto"), (3, "plain"), (3, "auto")}
    assert all(r["total_tok_s"] > 0 and r["ttft_p50_s"] > 0 for r in rows.values())
    assert rows[(1, "plain")]["rows_per_pass"] == pytest.approx(1.0)
    assert rows[(3, "plain")]["rows_per_pass"] > 1.5  # the three clients shared passes
    assert rows[(3, "auto")]["vs_plain"] > 0 and "3 clients:" in result["verdict"]
    assert main([*argv[:-1]]) == 0  # the table
    assert "clients | mode | total tok/s" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="client counts"):
        main(["bench", *pair, "--concurrency", "four"])


def test_each_run_is_compared_with_the_plain_run_beside_it() -> None:
    def run(rate: float) -> Run:  # decode tokens/s = rate
        return Run(tokens=101, decode_s=100 / rate, ttft_s=0.1)

    runs = {
        "plain": {"a": [run(10), run(20)], "b": [run(10), run(10)]},
        "auto": {"a": [run(12), run(18)], "b": [run(11), run(10)]},
    }
    rows = {r["mode"]: r for r in summarize(runs, ["plain", "auto"])}
    assert rows["auto"]["speedup_runs"] == [1.2, 0.9, 1.1, 1.0]
    assert rows["plain"]["speedup_runs"] == [1.0] * 4


def _row(mode: str, runs: list[float]) -> dict[str, object]:
    return {"mode": mode, "speedup": statistics.median(runs), "speedup_runs": runs}


def test_verdict_names_a_best_only_outside_the_noise() -> None:
    plain = _row("plain", [1.0, 1.0, 1.0])
    # The reported case: a median x1.13 from a mode that decoded plainly, one run slower.
    noisy = verdict([plain, _row("auto", [0.96, 1.13, 1.31]), _row("16", [0.7, 0.8, 1.05])])
    assert noisy.startswith("no block size beats plain decoding in every run")
    assert "best: auto, x1.13; x0.96 to x1.31 over 3 runs" in noisy
    clear = verdict([plain, _row("auto", [1.05, 1.13, 1.31]), _row("16", [0.99, 1.5, 1.6])])
    assert clear == "best: block size auto, x1.13 over plain decoding (x1.05 to x1.31 over 3 runs)"
    assert verdict([plain, _row("auto", [0.8, 0.9, 0.95])]).startswith("DFlash does not pay")
    assert "cannot tell" in verdict([_row("plain", [1.0]), _row("auto", [1.5])])
