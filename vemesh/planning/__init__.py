"""Before launch: which mesh (``vemesh plan``), and will it fit (``vemesh plan --model``).

* :mod:`~vemesh.planning.mesh_plan`: degrees to a mesh, with the lines to paste (pure);
* :mod:`~vemesh.planning.estimate`: the model on the meta device, its static memory per rank;
* :mod:`~vemesh.planning.activations`: one micro-batch traced on fake tensors;
* :mod:`~vemesh.planning.fit`: peak memory per rank class and bytes per dim; :mod:`~vemesh.planning.fit_report` prints them;
* :mod:`~vemesh.planning.measure`: the same, measured in a run.
"""
