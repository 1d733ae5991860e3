"""Driver-side callbacks for ``executor.run(fn, callbacks=[...])``, fed by what workers report.

``MetricsHistory`` keeps the per-step metrics (saved as PNG, CSV or JSON); ``ProgressBar`` is a live
``tqdm`` bar (terminal or notebook widget). Workers send records with
``hvdray.ray_logger.log({"epoch": e, "loss": ...})`` (any rank) or ``hvdray.report({...})`` (rank 0's);
records that carry the step key count. Tracking callbacks (TensorBoard, MLflow, W&B) are in ``tracking.py``.
"""

from __future__ import annotations

import json
import numbers
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from tqdm.auto import tqdm

if TYPE_CHECKING:  # pandas is imported when a table is read, not with every record
    import pandas as pd

PathLike = Union[str, Path]


class MetricsHistory:
    """Rows of metrics keyed by a step (``epoch`` by default), from one rank (rank 0 by default) or all."""

    def __init__(self, step_key: str = "epoch", rank: Optional[int] = 0) -> None:
        if not isinstance(step_key, str) or not step_key:
            raise ValueError(f"step_key must be a non-empty str, got {step_key!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"rank must be None (all ranks) or an int >= 0, got {rank!r}")
        self.step_key = step_key
        self.rank = rank
        self.rows: list[dict[str, Any]] = []

    def __call__(self, record: dict[str, Any]) -> None:
        """The executor callback: keep ``record`` if it has the step key and comes from the chosen rank."""
        if self.step_key not in record:
            return
        if self.rank is not None and record.get("rank", 0) != self.rank:
            return
        self.rows.append(dict(record))

    def __len__(self) -> int:
        return len(self.rows)

    def dataframe(self) -> "pd.DataFrame":
        """The rows as a pandas DataFrame, one column per key in the order first reported (missing: NaN)."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def metric_names(self) -> list[str]:
        """Numeric columns (booleans excluded) other than the step and the rank, in the order they first appeared."""
        from pandas.api.types import is_bool_dtype, is_numeric_dtype

        frame = self.dataframe()
        return [
            name for name in frame.columns
            if name not in (self.step_key, "rank") and is_numeric_dtype(frame[name]) and not is_bool_dtype(frame[name])
        ]

    def series(self, metric: str) -> tuple[list[Any], list[float]]:
        """(steps, values) of one metric, in the order reported (rows without it are skipped)."""
        if metric not in self.metric_names():
            raise KeyError(f"no metric {metric!r} was reported; have {self.metric_names()}")
        rows = self.dataframe()[[self.step_key, metric]].dropna(subset=[metric])
        return rows[self.step_key].tolist(), rows[metric].astype(float).tolist()

    def to_csv(self, path: PathLike) -> Path:
        """One line per row; columns: the step, the rank, then every other key in sorted order."""
        path = Path(path)
        frame = self.dataframe()
        rest = sorted(set(frame.columns) - {self.step_key, "rank"})
        frame.reindex(columns=[self.step_key, "rank", *rest]).to_csv(path, index=False)
        return path

    def to_json(self, path: PathLike) -> Path:
        """``{"step_key": ..., "rows": [...]}``."""
        path = Path(path)
        path.write_text(json.dumps({"step_key": self.step_key, "rows": self.rows}, indent=1, default=float))
        return path

    def plot(self, path: Optional[PathLike] = None, metrics: Optional[Sequence[str]] = None) -> Any:
        """A matplotlib Figure, one panel per metric against the step; saved as PNG if ``path`` is given."""
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        names = list(metrics) if metrics is not None else self.metric_names()
        if not names:
            raise ValueError("nothing to plot: no numeric metric has been reported yet")
        figure = Figure(figsize=(4.5 * len(names), 3.2), layout="constrained")
        for axes, name in zip(figure.subplots(1, len(names), squeeze=False)[0], names):
            steps, values = self.series(name)
            axes.plot(steps, values, marker="o", markersize=3)
            axes.set_xlabel(self.step_key)
            if all(float(step).is_integer() for step in steps):  # epochs: no tick at 1.5
                axes.xaxis.set_major_locator(MaxNLocator(integer=True))
            axes.set_title(name)
            axes.grid(alpha=0.3)
        if path is not None:
            figure.savefig(path, format="png", dpi=100)
        return figure


class _Discard:
    """A file that drops what tqdm draws: in line mode the bar's lines are written by ProgressBar itself."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _draws_in_place(file: Any) -> bool:
    """True where a bar can be redrawn in place: a notebook (a widget) or a terminal. A pipe, a file or a
    job's log (``ray job logs``) would keep every redraw, so there the bar writes one line per step."""
    from tqdm.notebook import tqdm as notebook_tqdm

    if issubclass(tqdm, notebook_tqdm):
        return True
    isatty = getattr(file, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class ProgressBar:
    """One tqdm bar fed by worker records (``hvdray.ray_logger.log``); close it, or use it as a context manager.

    In a terminal or a notebook the bar is redrawn in place. Where the output is not a terminal (piped,
    redirected to a file, a ``ray job submit`` driver's log) it writes one line per step instead, so a log
    holds each state of the bar once, not every redraw."""

    def __init__(
        self, total: Optional[int] = None, step_key: str = "epoch", rank: int = 0, desc: str = "training", **tqdm_kwargs: Any
    ) -> None:
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
            raise ValueError(f"total must be None or an int >= 0, got {total!r}")
        self.step_key = step_key
        self.rank = rank
        target = tqdm_kwargs.get("file") or sys.stderr
        self._lines: Optional[Any] = None if _draws_in_place(target) else target
        if self._lines is not None:
            tqdm_kwargs["file"] = _Discard()
        self.bar = tqdm(total=total, desc=desc, unit=step_key, **tqdm_kwargs)

    def __call__(self, record: dict[str, Any]) -> None:
        """The executor callback: one step per record of the chosen rank carrying the step key."""
        if self.step_key not in record or record.get("rank", 0) != self.rank:
            return
        shown = {
            k: f"{v:.4g}" for k, v in record.items()
            if k not in (self.step_key, "rank") and isinstance(v, numbers.Real) and not isinstance(v, bool)
        }
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)
        if self._lines is not None:
            self._lines.write(f"{self.bar}\n")
            self._lines.flush()

    def close(self) -> None:
        """Finish the bar."""
        self.bar.close()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
