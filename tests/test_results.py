"""ResultLogger and flatten_result: the files a training run leaves behind."""
import csv
import glob
import json
import math

import numpy as np
import pytest

from pipeline.results import ResultLogger, flatten_result, to_json_safe


def test_flatten_result_nested_keys_and_scalars():
    flat = flatten_result({
        "training_iteration": 3,
        "env_runners": {"episode_return_mean": np.float32(1.5), "num_episodes": np.int64(7)},
        "learners": {"default_policy": {"policy_loss": 0.25, "arr0d": np.array(2.0)}},
        "timers": {},
        "note": "text",
        "maybe": None,
        "flag": True,
        "episode_returns": [1.0, 2.0],       # lists are not scalars: left out
        "matrix": np.zeros((2, 2)),           # arrays with dimensions: left out
    })
    assert flat == {
        "training_iteration": 3,
        "env_runners/episode_return_mean": 1.5,
        "env_runners/num_episodes": 7,
        "learners/default_policy/policy_loss": 0.25,
        "learners/default_policy/arr0d": 2.0,
        "note": "text",
        "maybe": None,
        "flag": True,
    }
    assert type(flat["env_runners/num_episodes"]) is int
    assert type(flat["env_runners/episode_return_mean"]) is float


def test_to_json_safe_non_finite_and_numpy():
    out = to_json_safe({"a": float("nan"), "b": [float("inf"), -np.inf, np.float64(2.5)], "c": np.arange(3),
                        "d": {1: np.bool_(True)}})
    assert out == {"a": None, "b": [None, None, 2.5], "c": [0, 1, 2], "d": {"1": True}}
    json.dumps(out, allow_nan=False)


def _result(i, **extra):
    r = {"training_iteration": i, "env_runners": {"episode_return_mean": float("nan") if i == 1 else 10.0 * i,
                                                  "num_env_steps_sampled": np.int64(100)},
         "time_this_iter_s": np.float64(0.5), "episode_returns": [1.0, float("nan")]}
    r.update(extra)
    return r


def test_result_json_lines_are_strict_json_with_nan_as_null(tmp_path):
    with ResultLogger(tmp_path, params={"lr": 0.001, "env": "CartPole-v1", "gamma": np.float32(0.5)}) as logger:
        for i in (1, 2, 3):
            logger.log(_result(i))
    params = json.loads((tmp_path / "params.json").read_text())
    assert params == {"lr": 0.001, "env": "CartPole-v1", "gamma": 0.5}
    lines = (tmp_path / "result.json").read_text().splitlines()
    assert len(lines) == 3

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))

    rows = [strict(line) for line in lines]
    assert rows[0]["env_runners"]["episode_return_mean"] is None
    assert rows[0]["episode_returns"] == [1.0, None]
    assert rows[2]["env_runners"]["episode_return_mean"] == 30.0
    assert rows[1]["env_runners"]["num_env_steps_sampled"] == 100
    assert [r["training_iteration"] for r in rows] == [1, 2, 3]


def test_params_written_once(tmp_path):
    logger = ResultLogger(tmp_path, tensorboard=False)
    logger.write_params({"lr": 1})
    logger.write_params({"lr": 2})
    logger.close()
    assert json.loads((tmp_path / "params.json").read_text()) == {"lr": 1}


def test_progress_csv_handles_keys_appearing_later(tmp_path):
    logger = ResultLogger(tmp_path, tensorboard=False)
    logger.log(_result(1))
    logger.log(_result(2, evaluation={"env_runners": {"episode_return_mean": 99.0}}))
    logger.log(_result(3))
    logger.close()
    with open(tmp_path / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    key = "evaluation/env_runners/episode_return_mean"
    assert key in rows[0]
    assert [r[key] for r in rows] == ["", "99.0", ""]
    assert [r["training_iteration"] for r in rows] == ["1", "2", "3"]
    assert math.isnan(float(rows[0]["env_runners/episode_return_mean"]))
    assert float(rows[2]["env_runners/episode_return_mean"]) == 30.0
    assert "episode_returns" not in rows[0]  # lists are not columns
    header = (tmp_path / "progress.csv").read_text().splitlines()[0]
    assert header.count("training_iteration") == 1


def _read_scalars(path):
    """Minimal TFRecord reader: tag -> [(step, value)] from a tensorboardX event file."""
    import struct

    from tensorboardX.proto import event_pb2

    out = {}
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
        for v in event.summary.value:
            out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_tensorboard_event_file_has_scalars_by_iteration(tmp_path):
    with ResultLogger(tmp_path) as logger:
        logger.log(_result(1))
        logger.log(_result(2))
    events = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    assert len(events) == 1
    scalars = _read_scalars(events[0])
    assert scalars["env_runners/episode_return_mean"] == [(2, 20.0)]  # the NaN of iteration 1 is skipped
    assert scalars["training_iteration"] == [(1, 1.0), (2, 2.0)]
    assert scalars["env_runners/num_env_steps_sampled"] == [(1, 100.0), (2, 100.0)]
    assert not any(tag.startswith("episode_returns") for tag in scalars)


def test_tensorboard_tags_follow_tensorboards_rule(tmp_path):
    with ResultLogger(tmp_path) as logger:
        logger.log({"training_iteration": 1, "custom_metrics": {"lap time (s)": 3.5}, "/lead": 1.0})
    scalars = _read_scalars(glob.glob(str(tmp_path / "events.out.tfevents.*"))[0])
    assert scalars["custom_metrics/lap_time__s_"] == [(1, 3.5)]
    assert scalars["lead"] == [(1, 1.0)]
