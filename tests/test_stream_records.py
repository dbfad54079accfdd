"""stream.jsonl records (DESIGN.md contract) and the atomic writers everything uses."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fairseq_alma.errors import RunDirError
from fairseq_alma.stream.atomic import atomic_copy, atomic_write_bytes, atomic_write_json
from fairseq_alma.stream.records import (
    ArrivalRecord,
    read_records,
    records_equal,
    write_records,
)


def _record(arrival, **changes):
    fields = {
        "arrival": arrival,
        "stage": arrival,
        "trained": arrival > 0,
        "megabatches_seen": arrival,
        "params_active": 1000,
        "train_flops_cum": 6.0e9 * arrival,
        "infer_flops_per_token": 2.5e6,
        "wall_time": 1.5 * arrival,
        "eval_ppl": 50.0 - arrival,
        "eval_nll": 3.9,
        "eval_tokens": 4096,
    }
    fields.update(changes)
    return ArrivalRecord(**fields)


def test_round_trip_and_exact_line_layout(tmp_path):
    path = tmp_path / "stream.jsonl"
    records = [_record(0, valid={"valid_ppl": 60.0}), _record(1), _record(2)]
    write_records(path, records)
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert lines[0] == (
        '{"arrival": 0, "stage": 0, "trained": false, "megabatches_seen": 0, '
        '"params_active": 1000, "train_flops_cum": 0.0, "infer_flops_per_token": 2500000.0, '
        '"eval_ppl": 50.0, "eval_nll": 3.9, "eval_tokens": 4096, "valid_ppl": 60.0, '
        '"wall_time": 0.0}'
    )
    back = read_records(path)
    assert back == records
    assert records_equal(back, records)


def test_unknown_keys_are_kept_in_extra(tmp_path):
    obj = _record(1).to_json() | {"router_entropy": [0.5, 0.7], "valid_loss": 2.0}
    record = ArrivalRecord.from_json(obj)
    assert record.extra == {"router_entropy": [0.5, 0.7]}
    assert record.valid == {"valid_loss": 2.0}
    path = tmp_path / "s.jsonl"
    write_records(path, [record])
    assert json.loads(path.read_text())["router_entropy"] == [0.5, 0.7]


def test_rewrite_replaces_the_whole_file_no_duplicate_arrivals(tmp_path):
    path = tmp_path / "stream.jsonl"
    write_records(path, [_record(0), _record(1), _record(2)])
    write_records(path, [_record(0), _record(1)])  # a resumed run re-materialises its state
    assert [r.arrival for r in read_records(path)] == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["stream.jsonl"]  # no temp files left behind
    with pytest.raises(ValueError, match="increasing arrivals"):
        write_records(path, [_record(1), _record(1)])


def test_malformed_line_error_names_file_and_line(tmp_path):
    path = tmp_path / "stream.jsonl"
    good = json.dumps(_record(0).to_json())
    path.write_text(good + "\n" + '{"arrival": 1, "stage": 1\n')
    with pytest.raises(RunDirError) as info:
        read_records(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2: malformed stream record")
    assert "\n" not in message
    missing = dict(_record(1).to_json())
    del missing["stage"]
    path.write_text(good + "\n\n" + json.dumps(missing) + "\n")
    with pytest.raises(
        RunDirError, match=r":3: malformed stream record \(missing key\(s\) stage\)"
    ):
        read_records(path)
    path.write_text(json.dumps(_record(1).to_json()) + "\n" + good + "\n")
    with pytest.raises(RunDirError, match=r":2: arrival 0 follows arrival 1"):
        read_records(path)
    with pytest.raises(RunDirError, match="no such file"):
        read_records(tmp_path / "absent.jsonl")


def test_records_equal_ignores_only_wall_time():
    a = [_record(0), _record(1)]
    assert records_equal(a, [_record(0, wall_time=99.0), _record(1, wall_time=7.0)])
    assert not records_equal(a, [_record(0), _record(1, eval_ppl=48.5)])
    assert not records_equal(a, a[:1])
    assert records_equal(
        a, [_record(0), _record(1, eval_ppl=48.5)], ignore=("wall_time", "eval_ppl")
    )


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"eval_ppl": None}, "needs its metric"),
        (
            {"eval_ppl": None, "test_error": 1.5},
            r"test_error = 1.5 must be an error rate in \[0, 1\]",
        ),
        ({"trained": 1}, "trained = 1 must be true or false"),
        ({"params_active": -5}, "params_active = -5 must be an integer >= 0"),
        ({"train_flops_cum": float("inf")}, "train_flops_cum = inf must be a finite number"),
        ({"extra": {"stage": 3}}, "clash with record fields"),
    ],
)
def test_record_field_checks(changes, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        _record(1, **changes)


def test_vision_record_has_test_error_only():
    record = _record(2, eval_ppl=None, eval_nll=None, eval_tokens=None, test_error=0.25,
                     infer_flops_per_token=None, infer_flops_per_image=1e6)
    assert "eval_ppl" not in record.to_json() and record.to_json()["test_error"] == 0.25


def test_inference_flops_carry_their_unit():
    """An LM counts per token, vision per image; the other unit, or none, is refused."""
    with pytest.raises(ValueError, match="infer_flops_per_image given for a language model"):
        _record(1, infer_flops_per_image=5.0)
    with pytest.raises(ValueError, match="infer_flops_per_token = None must be a finite number"):
        _record(1, infer_flops_per_token=None)
    with pytest.raises(ValueError, match="infer_flops_per_token given for a vision record"):
        _record(1, eval_ppl=None, test_error=0.5)


def test_files_of_0_2_read_their_flops_in_the_unit_they_were_written_in():
    """fairseq-alma <= 0.2 wrote ``infer_flops_per_example``: per token for an LM, per image for
    vision; reading maps it, and writing uses the new names."""
    lm = _record(1).to_json()
    lm["infer_flops_per_example"] = lm.pop("infer_flops_per_token")
    assert ArrivalRecord.from_json(lm).infer_flops_per_token == 2.5e6
    vision = _record(1, eval_ppl=None, eval_nll=None, eval_tokens=None, test_error=0.5,
                     infer_flops_per_token=None, infer_flops_per_image=7.0).to_json()
    vision["infer_flops_per_example"] = vision.pop("infer_flops_per_image")
    back = ArrivalRecord.from_json(vision)
    assert back.infer_flops_per_image == 7.0 and "infer_flops_per_example" not in back.to_json()


def test_atomic_writes_replace_and_preserve_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "out.json"
    atomic_write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(target).st_mode & 0o777 == 0o666 & ~umask  # like open(), not mkstemp's 0o600
    with pytest.raises(ValueError, match=r"out.json: cannot write as JSON .*NaN/inf"):
        atomic_write_json(target, {"a": float("nan")})
    assert json.loads(target.read_text()) == {"a": 1}

    def crash(src, dst):  # the process "dies" right before the rename
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        atomic_write_bytes(target, b"half")
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"a": 1}
    assert os.listdir(target.parent) == ["out.json"]


def test_killed_writer_leaves_the_old_file_intact(tmp_path):
    # A real process SIGKILLed after writing its temp file but before os.replace.
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"old complete file")
    script = textwrap.dedent(f"""
        import os, signal
        from fairseq_alma.stream import atomic
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        atomic.atomic_write_bytes({str(target)!r}, b"new" * 100000)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=120, check=False
    )
    assert result.returncode == -9
    assert target.read_bytes() == b"old complete file"


def test_atomic_copy(tmp_path):
    src = tmp_path / "a.bin"
    src.write_bytes(bytes(range(256)) * 10)
    os.chmod(src, 0o640)
    dst = tmp_path / "out" / "b.bin"
    atomic_copy(src, dst)
    assert dst.read_bytes() == src.read_bytes()
    assert os.stat(dst).st_mode & 0o777 == 0o640
    with pytest.raises(FileNotFoundError, match="no such file to copy"):
        atomic_copy(tmp_path / "missing", dst)
