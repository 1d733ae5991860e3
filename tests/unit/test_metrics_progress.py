"""MetricsHistory and ProgressBar as executor callbacks, fed records shaped as ray_logger delivers them."""

from __future__ import annotations

import csv
import io
import json

import pytest

from hvdray.driver.callbacks import MetricsHistory
from hvdray.driver.callbacks import ProgressBar

RECORDS = [
    {"rank": 0, "epoch": 1, "loss": 2.0, "accuracy": 0.5, "phase": "warm-up"},
    {"rank": 1, "epoch": 1, "loss": 9.0},                       # another rank: ignored by default
    {"rank": 0, "hvdrayrun_stream": "stdout", "text": "hi"},  # no step key: ignored
    {"rank": 0, "epoch": 2, "loss": 1.0, "accuracy": 0.75},
    {"rank": 0, "epoch": 3, "loss": 0.5, "accuracy": 0.875},
]


def _history(**kwargs) -> MetricsHistory:
    history = MetricsHistory(**kwargs)
    for record in RECORDS:
        history(record)
    return history


def test_history_keeps_rank_zero_rows_with_a_step():
    history = _history()
    assert len(history) == 3
    assert history.metric_names() == ["loss", "accuracy"]
    assert history.series("loss") == ([1, 2, 3], [2.0, 1.0, 0.5])
    assert len(_history(rank=None)) == 4
    with pytest.raises(KeyError, match="no metric 'f1'"):
        history.series("f1")


def test_history_dataframe_has_a_column_per_key_and_series_skip_rows_without_the_metric():
    history = _history()
    history({"rank": 0, "epoch": 4, "accuracy": 0.9, "converged": True})  # no loss this step; a bool is no metric
    frame = history.dataframe()
    assert list(frame.columns) == ["rank", "epoch", "loss", "accuracy", "phase", "converged"]
    assert frame["epoch"].tolist() == [1, 2, 3, 4] and frame["loss"].isna().tolist() == [False, False, False, True]
    assert history.metric_names() == ["loss", "accuracy"]
    assert history.series("loss") == ([1, 2, 3], [2.0, 1.0, 0.5])
    assert history.series("accuracy") == ([1, 2, 3, 4], [0.5, 0.75, 0.875, 0.9])
    assert MetricsHistory().dataframe().empty


def test_history_saves_csv_json_and_png(tmp_path):
    history = _history()
    with history.to_csv(tmp_path / "h.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2", "3"] and rows[0]["phase"] == "warm-up" and rows[1]["phase"] == ""
    saved = json.loads(history.to_json(tmp_path / "h.json").read_text())
    assert saved["step_key"] == "epoch" and saved["rows"][2]["accuracy"] == 0.875
    figure = history.plot(tmp_path / "h.png", metrics=["loss"])
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [ax.get_title() for ax in figure.axes] == ["loss"]
    assert list(figure.axes[0].lines[0].get_ydata()) == [2.0, 1.0, 0.5]


@pytest.mark.parametrize("epochs", [2, 3, 5, 10])
def test_history_plot_ticks_whole_epochs(tmp_path, epochs):
    """An integer step (the epoch) gets integer ticks only, never 1.5; a fractional step keeps them."""
    history = MetricsHistory()
    for epoch in range(1, epochs + 1):
        history({"rank": 0, "epoch": epoch, "loss": 1.0 / epoch})
    axes = history.plot(tmp_path / "h.png").axes[0]  # saving draws it, placing the ticks
    low, high = axes.get_xlim()
    ticks = [t for t in axes.get_xticks() if low <= t <= high]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks

    fractional = MetricsHistory(step_key="time")
    for step in (0.5, 1.0, 1.5):
        fractional({"rank": 0, "time": step, "loss": step})
    axes = fractional.plot(tmp_path / "f.png").axes[0]
    assert any(not float(t).is_integer() for t in axes.get_xticks())


def test_history_rejects_bad_arguments():
    with pytest.raises(ValueError, match="step_key"):
        MetricsHistory(step_key="")
    with pytest.raises(ValueError, match="rank"):
        MetricsHistory(rank=-1)
    with pytest.raises(ValueError, match="nothing to plot"):
        MetricsHistory().plot()


def test_progress_bar_moves_one_step_per_rank_zero_record_and_shows_metrics():
    out = io.StringIO()
    with ProgressBar(total=3, file=out, mininterval=0) as progress:
        for record in RECORDS:
            progress(record)
        assert progress.bar.n == 3
    text = out.getvalue()
    assert "3/3" in text and "loss=0.5" in text and "accuracy=0.875" in text
    with pytest.raises(ValueError, match="total"):
        ProgressBar(total=-1, file=out)
