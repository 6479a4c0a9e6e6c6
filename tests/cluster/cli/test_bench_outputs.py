"""`specserve bench --json / --plot` into a folder that does not exist yet: made before the run starts, so a long
run's results are not lost when it ends."""

import argparse

from specserve.cluster.bench import runner
from specserve.cluster.cli import bench


def test_the_json_and_plot_folders_exist_before_the_run_starts(tmp_path, monkeypatch):
    seen = {}

    def main_bench(args):  # the run itself is the bench tests'; here only what it finds at its start
        seen["json"] = (tmp_path / "new" / "run").is_dir()
        seen["plot"] = (tmp_path / "plots").is_dir()
        return 0

    monkeypatch.setattr(runner, "main_bench", main_bench)
    args = argparse.Namespace(json=str(tmp_path / "new" / "run" / "bench.json"), plot=str(tmp_path / "plots" / "p.png"))
    assert bench._bench(args) == 0 and seen == {"json": True, "plot": True}
