"""``run.report`` in-process (no training): ``--report-to`` parsed and refused by name before launch,
W&B offline unless ``WANDB_MODE`` is set (a stand-in ``wandb`` module records the calls), the HF
Trainer's names, and ``loss.png`` skipped with one info line without matplotlib. The TensorBoard
event files of a real run are read back in ``test_cli.py``."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest

from ulysses_sp.run import report
from ulysses_sp.run.config import RunConfig


def test_report_to_choices_and_missing_packages_are_refused_by_name(monkeypatch):
    assert report.parse_report_to("none") == () and report.parse_report_to("tensorboard, wandb") == ("tensorboard", "wandb")
    with pytest.raises(ValueError, match="--report-to takes none, tensorboard, wandb .*got 'mlflow'"):
        report.parse_report_to("mlflow")
    monkeypatch.setattr(report.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="--report-to wandb needs the wandb package.*pip install wandb"):
        report.check_report_to("wandb")
    report.check_report_to("none")


class _FakeWandb(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits, self.logs, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, data, step):
        self.logs.append((step, data))

    def finish(self):
        self.finished += 1


@pytest.mark.parametrize("user_mode", [None, "online"])
def test_wandb_is_offline_unless_the_user_sets_wandb_mode(monkeypatch, tmp_path, user_mode):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    if user_mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", user_mode)
    cfg = RunConfig(output_dir=str(tmp_path / "run"), report_to="wandb", plot=False)
    (tmp_path / "run").mkdir()
    rep = report.MetricsReport(cfg)
    rep.log({"step": 1, "loss": 2.5, "grad_norm": 0.5, "lr": 1e-3, "tokens": 64, "tokens_per_s": 10.0,
             "peak_mem_bytes": 7, "skipped": True})  # fmt: skip
    rep.close()
    (init,) = fake.inits
    assert init["mode"] == ("offline" if user_mode is None else None)  # None: wandb follows WANDB_MODE
    assert init["dir"] == cfg.output_dir and init["config"]["report_to"] == "wandb"
    assert fake.logs == [(1, {"train/loss": 2.5, "train/grad_norm": 0.5, "train/learning_rate": 1e-3,
                              "train/num_input_tokens_seen": 64.0, "train/tokens_per_second": 10.0,
                              "train/peak_mem_bytes": 7.0, "train/global_step": 1})]  # fmt: skip
    assert fake.finished == 1
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["loss"] == 2.5


def test_loss_png_is_skipped_with_one_info_line_without_matplotlib(monkeypatch, tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i, "loss": 3.0 / i}) + "\n" for i in range(1, 4)) + '{"step": 4, "lo')
    assert report._loss_curve(str(path)) == ([1, 2, 3], [3.0, 1.5, 1.0])  # a torn last line left out
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    with caplog.at_level(logging.INFO, logger=report.__name__):
        assert report.plot_loss(str(path), str(tmp_path / "loss.png")) is None
    assert not (tmp_path / "loss.png").exists()
    assert [r.getMessage() for r in caplog.records] == [
        "matplotlib is not installed: no loss.png (pip install 'ulysses-sp[plot]')"
    ]
