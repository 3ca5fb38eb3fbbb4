"""Code shared by the tests and the worker scripts they launch (``import helpers.<module>``).

- :mod:`helpers.launch`: run a script on N local gloo processes with torchrun (hard timeout, no process left
  behind), and ``run_workers`` for ``dist_worker.py``'s training configurations.
- :mod:`helpers.compare`: tensors and training records compared with each other and with the one-process reference.
- :mod:`helpers.equivalence`: the fixed problem every equivalence test trains and its one-process reference run.
- :mod:`helpers.gather`: inside a launched worker, objects and full weights gathered from every rank.
- :mod:`helpers.settle`: inside a launched worker, the previous save committed before an injected fault.

``tests/conftest.py`` puts the tests folder on ``sys.path``; workers started by :func:`helpers.launch.torchrun`
find it through the ``PYTHONPATH`` the launcher sets. The worker scripts themselves (``dist_worker.py``,
``ft_worker.py``, ``hf_worker.py``, ...) stay at the top of ``tests/``, where the tests launch them by path.
"""
