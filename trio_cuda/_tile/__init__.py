"""Tile kernels (cuTile Python, ``cuda.tile``) for trio_cuda: the pieces a
``Kernel.from_tile`` kernel is built from.

* ``access``: which arrays a ``@ct.kernel`` reads and writes (leases).
* ``signature``: the specialisation signature and the ``cutile_python_v2``
  parameter layout; ``cache``: the kernel's digest and the on-disk cubin
  cache; ``compile``: ahead-of-time compilation to a cubin.
* ``emulate``: running a tile kernel on NumPy tiles (the simulator), built
  from the ``_emu_*`` modules (dtypes, tiles, memory ops, other ops).

Invariants: importing this package never imports ``cuda.tile`` (each module
imports it when first used), and nothing here runs on the event loop that can
take long (compilation runs in a worker thread, called by the runtime).
"""
