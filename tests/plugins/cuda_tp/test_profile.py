"""start_profile / stop_profile with tensor parallel: one trace per worker process."""

from __future__ import annotations

from pathlib import Path

from tests.core.test_profile import MODULE_OPS, check_traces, make_llm, profiled


def test_each_rank_writes_its_trace(tmp_path):
    with make_llm(
        executor="cuda-tp", tensor_parallel_size=2, **{"observability.profile_dir": str(tmp_path)}
    ) as llm:
        paths = profiled(llm)
        check_traces(paths, tmp_path, 2, MODULE_OPS)
        pids = {Path(p).name.split("-")[2] for p in paths}
        assert [Path(p).name.split("-")[1] for p in paths] == ["worker0", "worker1"]
        assert len(pids) == 2, paths
