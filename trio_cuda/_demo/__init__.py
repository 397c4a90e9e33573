"""The demo: the cancellation-safe batch job behind ``python -m trio_cuda demo``
and ``examples/batch_job.py``, on one device or on a Ray cluster.

* ``output``: what the job prints while it runs (result lines, progress, log).
* ``batch``: the job itself (``BatchConfig``, ``run_batch``, the kernels and
  the checks that nothing leaked).
* ``shard``: a shard of the job on Ray: what a worker runs, and the driver's
  checks and summary of what the shards sent back.
* ``ray``: the job on a Ray cluster (``demo --ray``): connecting, running the
  shards, collecting them, and the ``--ray`` options.
* ``cli``: the command line: the options, exit statuses and Ctrl-C.

Invariants:

* Imports inside the package go one way, in the order ``cli``, ``ray``,
  ``shard``, ``batch``, ``output``: a module imports only modules after it
  in that list, so there is no cycle, and this ``__init__`` imports none of
  them (importing one module loads only those below it).
* Nothing here imports Ray when it is imported: ``ray`` imports it only when
  ``--ray`` is given, and ``shard`` never does.
* The library does not import this package: ``import trio_cuda`` and
  ``import trio_cuda.__main__`` load none of it; ``trio_cuda.__main__``
  imports ``cli`` when it builds its parser or runs the ``demo`` command.
  The package is private: its names are for the command line, the example
  and the tests.
"""
