"""``bench/hf_check_sp_survey.py``: ``vemesh check`` on HF decoders under a first sequence-parallel plan, run as a user
runs the script (its check's ranks import it again, under its ``__main__`` guard)."""

from __future__ import annotations

import pytest
from bench_run import run_bench


@pytest.mark.slow
def test_the_sp_survey_says_what_gathers_the_sequence_and_that_the_tried_plan_is_exact(tmp_path) -> None:
    stdout, rows = run_bench("hf_check_sp_survey.py", "--models", "qwen2", json_out=tmp_path / "survey.json")
    (qwen2,) = rows
    assert qwen2["model"] == "qwen2" and qwen2["verdict"] == "differs" and qwen2["gathering hint"], stdout
    assert qwen2["recipe exact"] and qwen2["hint ends"] == "makes the check exact", stdout
    assert "1 of 1 exact with the recipes tried" in stdout, stdout
