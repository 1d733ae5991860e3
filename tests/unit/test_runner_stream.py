"""hvdrayrun's worker-side output stream and driver-side formatting, without Ray (a list as the sink)."""

from __future__ import annotations

import time

import pytest

from hvdray import ray_logger
from hvdray.runner.script import STREAM_KEY, _LineStream, format_record


@pytest.fixture
def sent():
    records: list[dict] = []
    ray_logger.set_sink(records.append)
    yield records
    ray_logger.set_sink(None)


def test_lines_are_batched_and_an_unfinished_line_waits_for_its_end(sent):
    stream = _LineStream("stdout")
    for i in range(500):
        print(f"line {i}", file=stream, flush=True)
    print("progress ", end="", file=stream, flush=True)
    deadline = time.monotonic() + 5
    while sum(r["text"].count("\n") + 1 for r in sent) < 500 and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for r in sent for line in r["text"].split("\n")]
    assert lines == [f"line {i}" for i in range(500)]
    assert len(sent) < 50  # batched, not one Ray call per line
    print("done", file=stream)
    stream.close()
    assert sent[-1] == {STREAM_KEY: "stdout", "text": "progress done"}


def test_close_sends_a_last_line_without_newline(sent):
    stream = _LineStream("stderr")
    stream.write("oops")
    stream.close()
    assert sent == [{STREAM_KEY: "stderr", "text": "oops"}]


def test_format_record_prefixes_every_line_with_rank_and_stream():
    assert format_record({"rank": 3, STREAM_KEY: "stderr", "text": "a\nb"}) == ["[3]<stderr>:a", "[3]<stderr>:b"]
    assert format_record({"rank": 0, "epoch": 1, "loss": 0.5}) == ["[0]<log>:epoch=1, loss=0.5"]
