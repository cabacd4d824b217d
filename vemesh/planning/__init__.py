"""Before launch: which mesh (``vemesh plan``), and will it fit (``vemesh plan --model``, :func:`plan`).

* :mod:`~vemesh.planning.mesh_plan`: degrees to a mesh, with the lines to paste (pure);
* :mod:`~vemesh.planning.estimate`: the model on the meta device, its static memory per rank;
* :mod:`~vemesh.planning.user_model`: the user's own factory, parallelize function and step, traced on a fake world
  (the GPT preset's too: :mod:`vemesh.models.gpt.planned`);
* :mod:`~vemesh.planning.pipeline_trace`: with PP, torch's schedule run on each PP rank's stages in that world;
* :mod:`~vemesh.planning.routing`: the routing a plan assumes for a mixture of experts (``--moe-load-factor``);
* :mod:`~vemesh.planning.fit`: peak memory per rank class and bytes per dim; :mod:`~vemesh.planning.fit_report` prints them;
* :mod:`~vemesh.planning.request`: :class:`PlanRequest`, the question, one value the CLI builds and :func:`plan` takes;
* :mod:`~vemesh.planning.api`: :func:`plan`, the same figures as ``vemesh plan --json``, from Python;
* :mod:`~vemesh.planning.measure`: the same, measured in a run.
"""

from vemesh.planning.api import plan
from vemesh.planning.request import PlanRequest

__all__ = ["PlanRequest", "plan"]
