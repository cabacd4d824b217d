"""Suite-wide: one thread per process, and the slow end-to-end runs start first.

The suite runs on 2 cores with 4 pytest-xdist workers (setup.cfg), and most of its time is processes that start
torch: intra-op threads beyond one only make them wait on each other. ``OMP_NUM_THREADS=1`` is set here, before any
test imports torch, and every process a test starts inherits it (torchrun sets the same for its workers); so is
writing bytecode (below).

With the workers of setup.cfg, a long run collected last leaves one worker busy while the others have finished;
started first, the short tests fill the gaps at the end. (Handing out the slow runs strictly first, with
``--dist load --maxschedchunk 1``, ran them all at once and took 1119 s against worksteal's 967 s: three
multi-process runs at a time on two cores cost more than they overlap.)
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The processes the tests start compile vemesh, the example and what the wheel's venv holds once, into the
# gitignored __pycache__ folders, instead of at every start: this machine sets PYTHONDONTWRITEBYTECODE, and a fresh
# clone has no bytecode (0.3 s more of every one of the suite's 300-odd processes; in the wheel's venv, 16 s).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

if importlib.util.find_spec("transformers") is not None:
    # A worker's checks fork their ranks from one server, the one its first check started (vemesh.local_ranks): that
    # server imports the libraries of that check's code only. Hugging Face's models are most of the checks, and each
    # rank importing transformers is 2.5 s of CPU (test_check.py on 2 cores: 159 s so, 89 s by the first check's
    # libraries, 63 s with every worker's server importing it once).
    from vemesh import local_ranks  # after OMP_NUM_THREADS: it imports torch

    local_ranks.PRELOAD += ("transformers", "transformers.modeling_utils")


@pytest.fixture(scope="session", autouse=True)
def _children_keep_their_temporary_files_in_the_session(tmp_path_factory: pytest.TempPathFactory):
    """The processes the tests start make their temporary files under this session's directory, which pytest prunes
    (it keeps the last 3 sessions): torchrun makes a ``torchelastic_*`` log directory in the temporary directory for
    every start and never removes it (about 60 a suite), and a killed process leaves what it had open."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    children = tmp_path_factory.mktemp("children-tmp", numbered=False)
    # torch.compile's caches stay where torch keeps them (under the temporary directory as it was): under the
    # session's, every run compiled the example's kernels anew (its compiled CP test: 38 s so, 19 s with them kept)
    preset = "TORCHINDUCTOR_CACHE_DIR" in os.environ
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(children)  # read by the processes started from here on; this one has its own already
    yield
    if not preset:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    if saved is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the order within each kind stays
