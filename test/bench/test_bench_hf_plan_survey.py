"""``bench/hf_plan_survey.py``: ``vemesh plan`` on an HF decoder against a 4-rank run of the same functions, run as a
user runs the script."""

from __future__ import annotations

import pytest
from bench_run import run_bench


@pytest.mark.slow
def test_the_plan_survey_plans_and_runs_a_checkpointed_hf_decoder_and_says_transformers_traced_branch(tmp_path) -> None:
    stdout, rows = run_bench("hf_plan_survey.py", "--models", "qwen2", "--modes", "fsdp-checkpointed",
                             json_out=tmp_path / "survey.json")
    (qwen2,) = rows
    assert "error" not in qwen2, stdout
    assert 1.0 <= qwen2["peak_ratio"] < 1.05 and qwen2["tracing_branch"], stdout  # the mask the plan keeps, said
    assert all(b["predicted"] == b["measured"] for b in qwen2["bytes"].values()), qwen2["bytes"]
    assert "1 of 1 planned and run; 0 said to leak" in stdout and not qwen2["leak_said"], stdout
