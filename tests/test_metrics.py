"""MetricsLogger: reduce modes, periods, export/merge exactness, checkpointing, errors, threading."""
import json
import math
import threading

import numpy as np
import pytest

from actors.metrics import REDUCE_MODES, MetricsLogger


def test_windowless_mean_min_max_cover_one_reduce_period():
    m = MetricsLogger()
    for v in (1.0, 2.0, 6.0):
        m.log_value("mean", v)
        m.log_value("min", v, reduce="min")
        m.log_value("max", v, reduce="max")
    assert m.peek("mean") == 3.0 and m.peek("min") == 1.0 and m.peek("max") == 6.0
    assert m.reduce() == {"mean": 3.0, "min": 1.0, "max": 6.0}
    for v in (10.0, 20.0):
        m.log_value("mean", v)
        m.log_value("min", v, reduce="min")
        m.log_value("max", v, reduce="max")
    assert m.reduce() == {"mean": 15.0, "min": 10.0, "max": 20.0}


def test_windowless_keeps_last_value_through_empty_period():
    m = MetricsLogger()
    m.log_value("loss", 0.5)
    m.log_value("lo", 3, reduce="min")
    m.log_value("hi", 3, reduce="max")
    first = m.reduce()
    assert first == {"loss": 0.5, "lo": 3, "hi": 3}
    assert m.peek("loss") == 0.5
    assert m.reduce() == first
    assert m.reduce() == first
    m.log_value("loss", 1.5)
    assert m.reduce()["loss"] == 1.5


def test_windowless_never_logged_in_period_and_never_reduced_is_nan():
    m = MetricsLogger()
    m.log_dict({}, prefix="x")
    assert math.isnan(m.peek("missing"))
    assert m.peek("missing", default=-1.0) == -1.0


def test_window_slides_and_survives_reduce():
    m = MetricsLogger()
    for mode in ("mean", "min", "max"):
        for v in (1, 2, 3, 4):
            m.log_value(f"w/{mode}", v, reduce=mode, window=3)
    assert m.reduce() == {"w": {"mean": 3.0, "min": 2, "max": 4}}
    # Nothing logged: the window is not cleared by reduce.
    assert m.reduce() == {"w": {"mean": 3.0, "min": 2, "max": 4}}
    for mode in ("mean", "min", "max"):
        m.log_value(f"w/{mode}", 10, reduce=mode, window=3)
    # Window is now [3, 4, 10].
    assert m.reduce() == {"w": {"mean": 17 / 3, "min": 3, "max": 10}}
    assert isinstance(m.peek("w/mean"), float)


def test_empty_window_is_nan():
    m = MetricsLogger()
    m.merge({"ret": {"reduce": "mean", "window": 5, "values": []}})
    assert "ret" in m
    assert math.isnan(m.peek("ret"))
    assert math.isnan(m.reduce()["ret"])


def test_sum_resets_on_reduce():
    m = MetricsLogger()
    m.log_value("steps", 3, reduce="sum")
    m.log_value("steps", 4, reduce="sum")
    assert m.peek("steps") == 7
    assert m.reduce() == {"steps": 7}
    assert m.peek("steps") == 0
    assert m.reduce() == {"steps": 0}
    m.log_value("steps", 2.5, reduce="sum")
    assert m.reduce() == {"steps": 2.5}


def test_lifetime_sum_survives_reduce_and_checkpoint():
    m = MetricsLogger()
    m.log_value("n", 5, reduce="lifetime_sum")
    assert m.reduce() == {"n": 5}
    m.log_value("n", 7, reduce="lifetime_sum")
    assert m.reduce() == {"n": 12}
    assert m.reduce() == {"n": 12}

    restored = MetricsLogger()
    restored.set_state(json.loads(json.dumps(m.get_state())))
    assert restored.peek("n") == 12
    restored.log_value("n", 1, reduce="lifetime_sum")
    assert restored.reduce() == {"n": 13}


def test_state_roundtrip_through_json_keeps_everything():
    m = MetricsLogger()
    for v in (1.0, 2.0, 3.0):
        m.log_value("ret", v, window=2)
    m.log_value("loss", 0.25)
    m.log_value("lo", 4, reduce="min")
    m.log_value("steps", 3, reduce="sum")
    m.log_value("never", 1.0)
    m.reduce()
    m.log_value("loss", 0.75)  # mid-period value is kept too
    m.log_value("fresh", 9, reduce="max")
    m.merge({"empty": {"reduce": "min", "window": 4, "values": []}})  # NaN peek must still serialise
    state = m.get_state()
    text = json.dumps(state, allow_nan=False)

    r = MetricsLogger()
    r.set_state(json.loads(text))
    assert r.get_state() == state
    assert r.keys() == m.keys()
    for key in m.keys():
        a, b = m.peek(key), r.peek(key)
        assert (math.isnan(a) and math.isnan(b)) or a == b, key
    assert r.reduce() == {"ret": 2.5, "loss": 0.75, "lo": 4, "steps": 0, "never": 1.0, "fresh": 9,
                          "empty": pytest.approx(math.nan, nan_ok=True)}
    # Restored keys keep their modes.
    with pytest.raises(ValueError, match="ret"):
        r.log_value("ret", 1.0)


def test_reduce_nests_slash_keys():
    m = MetricsLogger()
    m.log_value("a/b/c", 1.0)
    m.log_value("a/b/d", 2.0)
    m.log_value("a/e", 3, reduce="sum")
    m.log_value("top", 4.0)
    assert m.reduce() == {"a": {"b": {"c": 1.0, "d": 2.0}, "e": 3}, "top": 4.0}


def test_log_dict_prefix_and_nested_flattening():
    m = MetricsLogger()
    m.log_dict({"x": 1.0, "sub": {"y": 2.0, "deeper": {"z": 3.0}}}, prefix="learner")
    m.log_dict({"plain": 5})
    assert sorted(m.keys()) == ["learner/sub/deeper/z", "learner/sub/y", "learner/x", "plain"]
    assert m.reduce() == {"learner": {"x": 1.0, "sub": {"y": 2.0, "deeper": {"z": 3.0}}}, "plain": 5.0}


def test_log_dict_is_all_or_nothing():
    m = MetricsLogger()
    with pytest.raises(TypeError, match="bad"):
        m.log_dict({"good": 1.0, "bad": "x"})
    assert m.keys() == []


def test_counters_stay_ints_and_numpy_scalars_become_python_numbers():
    m = MetricsLogger()
    m.log_value("num_env_steps_sampled_lifetime", np.int64(40), reduce="lifetime_sum")
    m.log_value("num_env_steps_sampled_lifetime", 32, reduce="lifetime_sum")
    m.log_value("steps", np.int32(3), reduce="sum")
    m.log_value("lo", np.int64(5), reduce="min")
    m.log_value("hi", 5, reduce="max", window=3)
    m.log_value("mean", np.int64(2))
    m.log_value("f", np.float32(0.5))
    m.log_value("arr", np.array(1.5))
    out = m.reduce()
    assert out["num_env_steps_sampled_lifetime"] == 72
    for key in ("num_env_steps_sampled_lifetime", "steps", "lo", "hi"):
        assert type(out[key]) is int, key
    for key in ("mean", "f", "arr"):
        assert type(out[key]) is float, key
    assert json.dumps({"n": out["num_env_steps_sampled_lifetime"]}) == '{"n": 72}'
    exported = MetricsLogger()
    exported.log_value("c", np.int64(3), reduce="lifetime_sum")
    assert exported.export() == {"c": {"reduce": "lifetime_sum", "window": None, "value": 3}}
    assert type(exported.export().get("c", {"value": 0})["value"]) is int


def _log_all(m, values):
    """Log one batch: a windowed mean/min/max, windowless mean/min/max, a sum and a lifetime sum."""
    for v in values:
        m.log_value("ret/mean", v, window=4)
        m.log_value("ret/min", v, reduce="min", window=4)
        m.log_value("ret/max", v, reduce="max", window=4)
        m.log_value("loss", v)
        m.log_value("lo", v, reduce="min")
        m.log_value("hi", v, reduce="max")
        m.log_value("steps", int(v * 4), reduce="sum")
        m.log_value("lifetime", int(v * 4), reduce="lifetime_sum")


def test_export_then_merge_equals_logging_directly():
    # Quarter-multiples keep float sums exact in any order, so equality can be exact.
    batches = [
        ("a", [1.0, 2.5, -0.25]),
        ("b", [4.0]),
        ("a", [0.5, 3.75, 2.0, 1.25, 6.0, 0.0]),  # more values than the window between exports
        ("b", []),
        ("b", [-1.5, 2.25]),
        ("a", [8.0]),
    ]
    sources = {"a": MetricsLogger(), "b": MetricsLogger()}
    driver, direct = MetricsLogger(), MetricsLogger()
    for i, (name, values) in enumerate(batches):
        _log_all(sources[name], values)
        driver.merge(sources[name].export())
        _log_all(direct, values)
        if i % 2 == 1:  # reduce the driver at some points, mid-stream
            assert driver.reduce() == direct.reduce()
    assert driver.reduce() == direct.reduce()
    assert driver.reduce() == direct.reduce()  # the empty period repeats / resets the same way
    assert sources["a"].export() == {} and sources["b"].export() == {}


def test_merged_data_is_reexported_and_prefixed():
    runner, mid, driver = MetricsLogger(), MetricsLogger(), MetricsLogger()
    runner.log_value("ret", 2.0, window=10)
    runner.log_value("n", 3, reduce="lifetime_sum")
    mid.merge(runner.export(), prefix="env_runners")
    driver.merge(mid.export())
    assert driver.reduce() == {"env_runners": {"ret": 2.0, "n": 3}}


def test_export_format():
    m = MetricsLogger()
    for v in (1.0, 2.0, 3.0):
        m.log_value("w", v, window=2)
        m.log_value("mean", v)
        m.log_value("lo", v, reduce="min")
        m.log_value("s", v, reduce="sum")
        m.log_value("life", v, reduce="lifetime_sum")
    out = m.export()
    assert out == {
        "w": {"reduce": "mean", "window": 2, "values": [2.0, 3.0]},
        "mean": {"reduce": "mean", "window": None, "sum": 6.0, "count": 3},
        "lo": {"reduce": "min", "window": None, "value": 1.0},
        "s": {"reduce": "sum", "window": None, "value": 6.0},
        "life": {"reduce": "lifetime_sum", "window": None, "value": 6.0},
    }
    json.dumps(out)
    assert m.export() == {}
    m.log_value("life", 1.0, reduce="lifetime_sum")
    assert m.export() == {"life": {"reduce": "lifetime_sum", "window": None, "value": 1.0}}


def test_export_and_reduce_periods_are_independent():
    m = MetricsLogger()
    m.log_value("loss", 1.0)
    m.log_value("s", 2, reduce="sum")
    m.log_value("w", 5.0, window=3)
    m.export()
    assert m.reduce() == {"loss": 1.0, "s": 2, "w": 5.0}  # export did not clear the reduce period

    m.log_value("loss", 3.0)
    m.log_value("s", 4, reduce="sum")
    assert m.reduce() == {"loss": 3.0, "s": 4, "w": 5.0}
    # reduce did not clear the export period: both values since the last export are reported.
    assert m.export() == {
        "loss": {"reduce": "mean", "window": None, "sum": 3.0, "count": 1},
        "s": {"reduce": "sum", "window": None, "value": 4},
    }
    m.log_value("loss", 5.0)
    m.reduce()
    m.log_value("loss", 7.0)
    assert m.export()["loss"] == {"reduce": "mean", "window": None, "sum": 12.0, "count": 2}


def test_log_time_logs_non_negative_duration():
    m = MetricsLogger()
    with m.log_time("timers/sample"):
        sum(range(1000))
    with m.log_time("timers/total", reduce="sum"):
        pass
    t = m.peek("timers/sample")
    assert isinstance(t, float) and t >= 0.0
    assert m.peek("timers/total") >= 0.0


def test_log_time_checks_mode_before_running_block():
    m = MetricsLogger()
    m.log_value("t", 1.0, reduce="sum")
    ran = []
    with pytest.raises(ValueError, match="'t'"):
        with m.log_time("t", reduce="max"):
            ran.append(True)
    assert ran == []


def test_mode_or_window_clash_raises_naming_key_and_modes():
    m = MetricsLogger()
    m.log_value("episode_return", 1.0, window=100)
    with pytest.raises(ValueError, match="episode_return") as err:
        m.log_value("episode_return", 1.0, reduce="max", window=100)
    assert "'mean'" in str(err.value) and "'max'" in str(err.value)
    with pytest.raises(ValueError, match="episode_return") as err:
        m.log_value("episode_return", 1.0, window=10)
    assert "100" in str(err.value) and "10" in str(err.value)
    with pytest.raises(ValueError, match="episode_return"):
        m.log_value("episode_return", 1.0)
    with pytest.raises(ValueError, match="episode_return"):
        m.merge({"episode_return": {"reduce": "mean", "window": None, "sum": 1.0, "count": 1}})
    assert m.peek("episode_return") == 1.0


def test_unknown_reduce_lists_modes():
    m = MetricsLogger()
    with pytest.raises(ValueError, match="k") as err:
        m.log_value("k", 1.0, reduce="median")
    assert all(mode in str(err.value) for mode in REDUCE_MODES)
    assert "k" not in m


@pytest.mark.parametrize("window", [0, -3, 2.5, "5", True])
def test_bad_window(window):
    with pytest.raises(ValueError, match="my_key"):
        MetricsLogger().log_value("my_key", 1.0, window=window)


def test_window_on_sum_is_rejected():
    with pytest.raises(ValueError, match="c"):
        MetricsLogger().log_value("c", 1, reduce="sum", window=3)


@pytest.mark.parametrize("value", ["1.0", None, [1.0], 1 + 2j, np.array([1.0, 2.0])])
def test_non_numeric_value_raises_type_error_naming_key(value):
    m = MetricsLogger()
    with pytest.raises(TypeError, match="the_key"):
        m.log_value("the_key", value)
    assert "the_key" not in m


def test_leaf_and_branch_clash():
    m = MetricsLogger()
    m.log_value("a/b", 1.0)
    with pytest.raises(ValueError, match="a/b"):
        m.log_value("a", 1.0)
    with pytest.raises(ValueError, match="a/b"):
        m.log_value("a/b/c", 1.0)


def test_keys_and_contains():
    m = MetricsLogger()
    m.log_value("x", 1.0)
    m.log_value("y/z", 1, reduce="sum")
    assert m.keys() == ["x", "y/z"]
    assert "x" in m and "y/z" in m and "y" not in m


def test_threaded_logging_while_exporting_loses_nothing():
    m = MetricsLogger()
    n_threads, per_thread = 4, 10_000
    start = threading.Barrier(n_threads + 1)

    def work():
        start.wait()
        for _ in range(per_thread):
            m.log_value("count", 1, reduce="lifetime_sum")

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    start.wait()
    total = 0
    while any(t.is_alive() for t in threads):
        total += m.export().get("count", {"value": 0})["value"]
    for t in threads:
        t.join()
    total += m.export().get("count", {"value": 0})["value"]
    assert total == n_threads * per_thread
    assert m.peek("count") == n_threads * per_thread


def test_log_values_equals_logging_each_value():
    one, many = MetricsLogger(), MetricsLogger()
    values = [3.0, 1.0, 4.0, 1.0, 5.0]
    for reduce, window in (("mean", 3), ("min", None), ("max", 2), ("sum", None), ("lifetime_sum", None)):
        key = f"k_{reduce}"
        for v in values:
            one.log_value(key, v, reduce=reduce, window=window)
        many.log_values(key, values, reduce=reduce, window=window)
    assert many.export() == one.export() and many.reduce() == one.reduce()
    with pytest.raises(ValueError, match="k_sum"):
        many.log_values("k_sum", [1.0], reduce="mean")
