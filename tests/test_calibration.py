"""The calibration cache: costs measured at load are read back at the next load of the same pair
on the same machine, measured again otherwise, and a damaged file is a warning, never a crash."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflash_server.adaptive.costs import CostModel
from dflash_server.adaptive.pass_costs import PassCosts
from dflash_server.engine import calibration
from dflash_server.engine.calibration import CalibrationCache, default_folder
from dflash_server.engine.loader import load_models
from dflash_server.settings import Settings
from server_fixtures import ScriptedGenerate, start_engine

COSTS = CostModel(
    plain=0.01,
    verify={1: 0.01, 2: 0.012, 8: 0.02},
    draft={2: 0.003, 8: 0.004},
    measured_s=1.5,
    residual={1: 0.1, 2: -0.05},
    verify_residual={2: 0.2},
)


class Measure:
    """A stand-in measurement that counts its runs."""

    def __init__(self, value: object = COSTS) -> None:
        self.value, self.runs = value, 0

    def __call__(self) -> object:
        self.runs += 1
        return self.value


def fetch(
    folder: Path | None, measure: Measure, fingerprint: str = "pair", **params: int
) -> object:
    return CalibrationCache(folder, fingerprint).fetch("cycle", CostModel, measure, **params)


def test_a_hit_returns_the_measured_values_without_measuring(tmp_path: Path) -> None:
    measure = Measure()
    assert fetch(tmp_path, measure, widest=33) == COSTS and measure.runs == 1
    assert fetch(tmp_path, measure, widest=33) == COSTS and measure.runs == 1
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]  # no temporary file left


@pytest.mark.parametrize(
    "change",
    [
        lambda cache, m: fetch(cache, m, fingerprint="another pair"),
        lambda cache, m: fetch(cache, m, widest=9),
        lambda cache, m: CalibrationCache(cache, "pair").fetch("batch", CostModel, m),
    ],
    ids=["fingerprint", "params", "kind"],
)
def test_another_pair_or_parameters_miss(tmp_path: Path, change: Callable) -> None:
    measure = Measure()
    fetch(tmp_path, measure)
    change(tmp_path, measure)
    assert measure.runs == 2


def test_another_machine_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measure = Measure()
    fetch(tmp_path, measure)
    other = {**calibration.machine(), "device": "Device(gpu, 0)"}
    monkeypatch.setattr(calibration, "machine", lambda: other)
    fetch(tmp_path, measure)
    assert measure.runs == 2


def test_the_machine_key_names_what_changes_speed() -> None:
    key = calibration.machine()
    assert {"cpu", "mlx", "device", "openblas", "env", "code"} <= set(key)
    json.dumps(key)  # it is written into every file


def _damage(how: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = json.loads(path.read_text())
        if how == "zeroed":
            path.write_bytes(bytes(path.stat().st_size))
        elif how == "truncated":
            path.write_text(path.read_text()[:40])
        elif how == "not a number":
            data["value"]["plain"] = "fast"
            path.write_text(json.dumps(data))
        elif how == "unknown field":
            data["value"]["speed"] = 1.0
            path.write_text(json.dumps(data))
        elif how == "other key":
            data["key"]["fingerprint"] = "another pair"
            path.write_text(json.dumps(data))

    return damage


@pytest.mark.parametrize(
    "how", ["zeroed", "truncated", "not a number", "unknown field", "other key"]
)
def test_a_damaged_file_is_a_warning_and_a_new_measurement(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    measure = Measure()
    fetch(tmp_path, measure)
    (path,) = tmp_path.iterdir()
    _damage(how)(path)
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        assert fetch(tmp_path, measure) == COSTS
    assert measure.runs == 2
    assert f"ignoring calibration file {path}" in caplog.text
    assert fetch(tmp_path, measure) == COSTS and measure.runs == 2  # written again, whole


def test_off_measures_every_time_and_writes_nothing(tmp_path: Path) -> None:
    measure = Measure()
    fetch(None, measure)
    fetch(None, measure)
    assert measure.runs == 2
    assert Settings.load(target="t", draft="d", calibration_cache="off").calibration_folder is None


def test_an_unwritable_folder_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        assert fetch(tmp_path / "file" / "calibration", Measure()) == COSTS
    assert "cannot write calibration file" in caplog.text


def test_the_default_folder_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_folder() == tmp_path / "dflash-server" / "calibration"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_folder() == Path.home() / ".cache" / "dflash-server" / "calibration"
    monkeypatch.delenv("DFLASH_CALIBRATION_CACHE", raising=False)
    assert Settings.load(target="t", draft="d").calibration_folder == default_folder()
    folder = Settings.load(target="t", draft="d", calibration_cache="~/c").calibration_folder
    assert folder == Path.home() / "c"


def test_a_second_load_reads_both_costs_back(
    tiny_hybrid_path: Path,
    draft_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real measurements: the cycle costs at load, the batched pass costs in the engine; the
    second load takes both from the files, equal to what was measured."""
    from dflash_server.generation import calibrate_passes as batch_budget
    from dflash_server.generation import pair

    def load() -> tuple[CostModel, PassCosts]:
        models = load_models(str(tiny_hybrid_path), str(draft_path), calibration_cache=tmp_path)
        engine = start_engine(models, ScriptedGenerate([]))
        engine.stop()
        assert models.pair.costs.measured is not None and engine.batch and engine.batch.costs
        return models.pair.costs.measured, engine.batch.costs

    measured = load()
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["batch", "cycle"]

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured again")

    monkeypatch.setattr(pair, "measure_costs", never)
    monkeypatch.setattr(batch_budget, "measure_pass_costs", never)
    with caplog.at_level(logging.INFO, logger="dflash_server"):
        assert load() == measured
    hits = [
        r.getMessage() for r in caplog.records if "from the calibration cache" in r.getMessage()
    ]
    assert [m.split()[0] for m in hits] == ["cycle", "batch"]
    assert "--calibration-cache off" in hits[0]


def test_measuring_lets_other_models_run_every_cycle_or_two(
    tiny_hybrid: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first load measures the pair's costs on the worker that runs other models' passes:
    between two of its pause points it runs one cycle wider than a prompt piece (a prompt is
    prefilled 8 tokens at a time, and one speculative cycle is timed per short decode; the
    decoder queues the next, which runs during the pause), so a stream on another model waits
    about one of this pair's passes, not a whole calibration decode
    (docs/design.md, "Several models")."""
    from dflash_server.generation.calibrate import measure_costs
    from dflash_server.generation.calibrate_passes import measure_pass_costs
    from dflash_server.generation.pauses import pausing
    from dflash_server.generation.target import TargetModel
    from dflash_server.testing import random_drafter

    model, _ = tiny_hybrid
    draft = random_drafter(model, block_size=8)
    stretches: list[list[int]] = [[]]
    forward = TargetModel.forward

    def counted(self: Any, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        stretches[-1].append(tokens.shape[1])
        return forward(self, tokens, *args, **kwargs)

    def hook() -> bool:
        stretches.append([])
        return False

    monkeypatch.setattr(TargetModel, "forward", counted)
    with pausing(hook):
        costs = measure_costs(model, draft, long_context=256, widest=16)
        measure_pass_costs(TargetModel(model, draft.config.target_layer_ids), draft, growth=costs)
    # The timed cycle, and the next one the decoder queues (it runs during the pause).
    widest = [[w for w in s if w > 8] for s in stretches]  # wider than a prompt piece
    assert max(len(s) for s in widest) <= 2, max(widest, key=len)
    assert max(max(s, default=0) for s in stretches) <= 16


def test_beside_other_streams_a_measurement_times_only_what_its_ceiling_holds(
    tiny_hybrid: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other models streaming (they ran at the first pause): each timed piece is held to
    ``HELD_STEPS`` plain steps. With a ceiling of 0 steps only the two narrowest sizes of each
    curve are timed and wider ones extend it (the cycle residuals at the widest one's), so no
    forward wider than a prompt piece runs while the cycle costs are measured, and the
    result is ``partial`` (docs/design.md, "Several models")."""
    from dflash_server.generation import calibrate, calibrate_passes
    from dflash_server.generation.pauses import pausing
    from dflash_server.generation.target import TargetModel
    from dflash_server.testing import random_drafter

    model, _ = tiny_hybrid
    draft = random_drafter(model, block_size=8)
    monkeypatch.setattr(calibrate, "HELD_STEPS", 0)
    monkeypatch.setattr(calibrate_passes, "HELD_STEPS", 0)
    widths: list[int] = []
    forward = TargetModel.forward

    def counted(self: Any, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        widths.append(tokens.shape[1])
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(TargetModel, "forward", counted)
    with pausing(lambda: True):
        costs = calibrate.measure_costs(model, draft, long_context=256, widest=16)
        assert max(widths) <= calibrate_passes.PREFILL_PIECE
        target = TargetModel(model, draft.config.target_layer_ids)
        passes = calibrate_passes.measure_pass_costs(target, draft, growth=costs)
    assert costs.partial and passes.partial
    assert sorted(costs.verify) == [1, 2, 4]
    assert costs.cycle(16) >= costs.cycle(8) >= costs.cycle(4)  # the curve goes on rising
    assert costs.residual[4] == costs.residual[8] == costs.residual[2]
    assert sorted(costs.verify_residual) == [2, 4, 8, 16]
    assert sorted(passes.plain) == [1, 2] and sorted(passes.speculative) == [4, 16]
    with pausing(lambda: False):  # nobody else streaming: everything is timed
        whole = calibrate.measure_costs(model, draft, long_context=256, widest=16)
    assert not whole.partial and sorted(whole.verify) == [1, 2, 4, 8, 16]


def test_a_partial_measurement_is_measured_whole_at_a_load_alone(tmp_path: Path) -> None:
    """Costs measured beside other models' streams are kept and read back while others stream
    (a reload stays quick); a load with no other model streaming measures them whole."""
    from dataclasses import replace

    from dflash_server.generation.pauses import pausing

    partial = replace(COSTS, partial=True)
    with pausing(lambda: True):
        assert fetch(tmp_path, Measure(partial)) == partial
        whole = Measure()
        assert fetch(tmp_path, whole) == partial and whole.runs == 0
    assert fetch(tmp_path, whole) == COSTS and whole.runs == 1
    assert fetch(tmp_path, whole) == COSTS and whole.runs == 1  # kept whole
