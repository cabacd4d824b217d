"""``bench/hf_check_survey.py``: ``vemesh check`` on HF decoders under torch's plain TP styles, run as a user runs the
script (its check's ranks import it again, under its ``__main__`` guard)."""

from __future__ import annotations

import pytest
from bench_run import run_bench


@pytest.mark.slow
def test_the_survey_gives_each_models_verdict_and_the_recipe_its_hints_name(tmp_path) -> None:
    stdout, rows = run_bench("hf_check_survey.py", "--models", "bloom", json_out=tmp_path / "survey.json")
    (bloom,) = rows
    assert bloom["model"] == "bloom" and bloom["verdict"] == "differs" and bloom["recipe exact"] and bloom["hints name"] == [
        "module.hidden_size //= tp", "module.num_heads //= tp",
        "HeadwiseParallel(inputs={'alibi': 0}, heads=4)"], stdout
