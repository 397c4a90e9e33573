"""Tile kernels (cuTile Python, ``cuda.tile``) for trio_cuda: the pieces a
``Kernel.from_tile`` kernel is built from.

* ``access``: which arrays a ``@ct.kernel`` reads and writes (leases).
* ``compile``: the specialisation signature, ahead-of-time compilation to a
  cubin and its on-disk cache.
* ``emulate``: running a tile kernel on NumPy tiles (the simulator).

Invariants: importing this package never imports ``cuda.tile`` (each module
imports it when first used), and nothing here runs on the event loop that can
take long (compilation runs in a worker thread, called by the runtime).
"""
