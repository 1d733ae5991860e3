"""``ProgressBar``: a live ``tqdm`` bar (terminal or notebook widget) advanced by what workers report.

Pass it as a callback: ``executor.run(train, callbacks=[ProgressBar(total=epochs)])``; each record
from rank 0 that carries the step key moves the bar one step and shows its other numbers.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

from tqdm.auto import tqdm


class ProgressBar:
    """One tqdm bar fed by worker records (``hvdray.ray_logger.log``); close it, or use it as a context manager."""

    def __init__(
        self, total: Optional[int] = None, step_key: str = "epoch", rank: int = 0, desc: str = "training", **tqdm_kwargs: Any
    ) -> None:
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
            raise ValueError(f"total must be None or an int >= 0, got {total!r}")
        self.step_key = step_key
        self.rank = rank
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

    def close(self) -> None:
        """Finish the bar."""
        self.bar.close()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
