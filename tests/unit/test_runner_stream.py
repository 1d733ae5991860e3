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


def _run_here(spec):
    """run_script in this process, as a worker runs it (rank from HOROVOD_RANK, output to the sink)."""
    from hvdray.runner.script import run_script

    return run_script(spec)


def test_run_script_runs_a_file_as_main_with_argv_and_restores_the_process(sent, tmp_path, monkeypatch):
    import os
    import sys

    from hvdray.runner.script import ScriptSpec

    script = tmp_path / "train.py"
    script.write_text("import os, sys\nprint(__name__, sys.argv[1:], os.getcwd())\n")
    monkeypatch.setenv("HOROVOD_RANK", "2")
    argv, cwd, path = list(sys.argv), os.getcwd(), list(sys.path)
    # The source travels along: a node without the file runs a copy of it.
    spec = ScriptSpec(script=str(tmp_path / "elsewhere" / "train.py"), source=script.read_text(),
                      args=("--lr", "0.1"), cwd=str(tmp_path))
    assert _run_here(spec) == 0
    assert sent == [{STREAM_KEY: "stdout", "text": f"__main__ ['--lr', '0.1'] {tmp_path}"}]
    assert (sys.argv, os.getcwd(), sys.path) == (argv, cwd, path)


def test_run_script_runs_a_module_from_the_working_directory(sent, tmp_path):
    from hvdray.runner.script import ScriptSpec

    (tmp_path / "mytrain").mkdir()
    (tmp_path / "mytrain" / "__init__.py").write_text("")
    (tmp_path / "mytrain" / "main.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    assert _run_here(ScriptSpec(module="mytrain.main", args=("x",), cwd=str(tmp_path))) == 0
    assert sent[-1]["text"] == "__main__ ['x']"


@pytest.mark.parametrize("body, code, summary", [
    ("import sys\nsys.exit(3)\n", 3, "SystemExit(3)"),
    ("import sys\nsys.exit('no data')\n", 1, "SystemExit('no data')"),
    ("raise KeyError('w')\n", 1, "KeyError: 'w'"),
])
def test_run_script_turns_a_failure_into_script_failed_with_the_exit_code(sent, tmp_path, monkeypatch, body, code, summary):
    from hvdray.runner.script import ScriptFailed, ScriptSpec

    script = tmp_path / "bad.py"
    script.write_text(body)
    monkeypatch.setenv("HOROVOD_RANK", "1")
    with pytest.raises(ScriptFailed) as failure:
        _run_here(ScriptSpec(script=str(script), source=body, args=()))
    assert (failure.value.rank, failure.value.exit_code, failure.value.summary) == (1, code, summary)
    if code == 1 and "KeyError" in summary:
        text = "\n".join(r["text"] for r in sent)
        assert f'File "{script}", line 1, in <module>' in text and "runpy" not in text


def test_sys_exit_zero_is_success(sent, tmp_path):
    from hvdray.runner.script import ScriptSpec

    script = tmp_path / "ok.py"
    script.write_text("import sys\nsys.exit(0)\n")
    assert _run_here(ScriptSpec(script=str(script), source="", args=())) == 0
