"""`cxrfl bench compare|cwt|fedfew|speed|pretrain`: each subcommand reaches its benchmark with the options
given; `bench compare --method cwt|fedfew` runs those benchmarks; the former `bench-cwt` / `bench-fedfew`
still run, naming the new command."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from cxrfl.cli import build_parser, main
from cxrfl.errors import ConfigError


@pytest.fixture()
def fedfew_calls(monkeypatch):
    import cxrfl.bench.fedfew as bench_fedfew

    calls = []
    monkeypatch.setattr(
        bench_fedfew, "run_fedfew_benchmark", lambda out, seeds, **kw: calls.append({"out": out, "seeds": seeds, **kw})
    )
    return calls


def run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def test_bench_fedfew_options_reach_the_benchmark(tmp_path, fedfew_calls):
    from cxrfl.bench.fedfew import QUICK

    assert (
        run(
            [
                "bench",
                "fedfew",
                "--quick",
                "--methods",
                "mlc,fedfew",
                "--rounds",
                "3",
                "--jobs",
                "1",
                "--out",
                str(tmp_path),
                "--seeds",
                "2",
                "--no-resume",
                "--arch",
                "densenet-tiny",
            ]
        )
        == 0
    )
    (call,) = fedfew_calls
    s = call["settings"]
    assert call["out"] == tmp_path and call["seeds"] == 2 and call["resume"] is False
    assert s.methods == ("mlc", "fedfew") and s.fedfew["rounds"] == 3 and s.jobs == 1 and s.n_cc == QUICK.n_cc
    assert s.arch == "densenet-tiny" and QUICK.arch == "densenet121" and call["only"] is None
    run(["bench", "fedfew", "--seeds", "8", "--only-seeds", "2, 3", "--out", str(tmp_path)])
    assert fedfew_calls[-1]["seeds"] == 8 and fedfew_calls[-1]["only"] == [2, 3]
    with pytest.raises(ConfigError, match="--only-seeds takes comma-separated whole numbers"):
        run(["bench", "fedfew", "--only-seeds", "2-3", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match="arch must be one of"):
        run(["bench", "fedfew", "--arch", "resnet50", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"unknown method\(s\) \['mlcc'\]"):
        run(["bench", "fedfew", "--methods", "mlcc", "--out", str(tmp_path)])


def test_compare_method_fedfew_runs_the_fedfew_benchmark(tmp_path, fedfew_calls):
    from cxrfl.bench.fedfew import FedFewBenchSettings

    for extra in ([], ["--profile", "fedfew"]):
        assert run(["bench", "compare", "--method", "fedfew", *extra, "--out", str(tmp_path), "--seeds", "2"]) == 0
    assert [(c["out"], c["seeds"], c["settings"]) for c in fedfew_calls] == [(tmp_path, 2, FedFewBenchSettings())] * 2
    with pytest.raises(ConfigError, match="fedfew profile only"):
        run(["bench", "compare", "--method", "fedfew", "--profile", "two-hospitals", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match="--method must be 'cwt' or 'fedfew'"):
        run(["bench", "compare", "--method", "fedavg", "--out", str(tmp_path)])
    assert len(fedfew_calls) == 2


def test_former_bench_fedfew_command_names_the_new_one(tmp_path, fedfew_calls, capsys):
    assert main(["bench-fedfew", "--out", str(tmp_path), "--seeds", "1"]) == 0
    assert "'bench-fedfew' is now 'cxrfl bench fedfew'" in capsys.readouterr().err
    assert fedfew_calls[0]["seeds"] == 1 and fedfew_calls[0]["out"] == tmp_path


@dataclass(frozen=True)
class FakeCWTSettings:
    seeds: int = 5
    cycles: int = 30
    splits: tuple[int, ...] = tuple(range(1, 11))
    synthetic_images: int = 3000
    arch: str = "densenet121"


def test_bench_cwt_and_compare_method_cwt_reach_the_cwt_benchmark(tmp_path, monkeypatch, capsys):
    calls = []
    fake = type(sys)("cxrfl.bench.cwt")
    fake.CWTBenchSettings = FakeCWTSettings
    fake.run_cwt_benchmark = lambda out, seeds, **kw: calls.append({"out": out, "seeds": seeds, **kw})
    monkeypatch.setitem(sys.modules, "cxrfl.bench.cwt", fake)
    assert run(["bench", "cwt", "--out", str(tmp_path), "--seeds", "2", "--splits", "1,10", "--cycles", "5"]) == 0
    assert (
        run(["bench", "compare", "--method", "cwt", "--out", str(tmp_path), "--seeds", "4", "--arch", "densenet-tiny"])
        == 0
    )
    assert main(["bench-cwt", "--out", str(tmp_path)]) == 0
    assert "'bench-cwt' is now 'cxrfl bench cwt'" in capsys.readouterr().err
    first, second, third = calls
    assert first["out"] == Path(tmp_path) and first["settings"].splits == (1, 10) and first["settings"].cycles == 5
    assert first["resume"] is True and first["seeds"] == first["settings"].seeds == 2
    assert second["seeds"] == 4 and second["settings"].splits == tuple(range(1, 11))
    assert first["settings"].arch == "densenet121" and second["settings"].arch == "densenet-tiny"  # passed on
    assert third["seeds"] == 5 and callable(third["log"])


def test_every_training_benchmark_takes_the_one_arch_option():
    from cxrfl.bench.arch import BENCHES

    for bench in BENCHES:
        assert (
            build_parser().parse_args(["bench", bench, "--out", "o", "--arch", "densenet-tiny"]).arch == "densenet-tiny"
        )
    with pytest.raises(SystemExit):  # speed, load and pretrain measure DenseNet121 itself
        build_parser().parse_args(["bench", "speed", "--out", "o", "--arch", "densenet-tiny"])


def test_load_benchmark_job_and_label_sets(tmp_path):
    import json

    from cxrfl.bench.load import LoadSettings, label_sets, make_job

    job = make_job(tmp_path, LoadSettings(rounds=2, image_size=32, steps=3))
    args = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())["workflows"][0]["args"]
    assert (args["num_rounds"], args["patience"], args["min_clients"]) == (2, 3, 2)
    assert args["model_config"]["image_size"] == 32 and args["train_config"]["max_steps_per_epoch"] == 3
    assert label_sets({"Mass": ["b", "a"], "Edema": ["a"]}) == {"b": ["Mass"], "a": ["Edema", "Mass"]}
