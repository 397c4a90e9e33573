"""A cancellation-safe GPU batch job.

64 input vectors go through two kernels (saxpy, then scale_shift), 8 at a time.
A deadline cancels the rest of the batch while kernels are still in flight;
every result that completed is checked against the kernels' NumPy references,
and the job then checks that nothing leaked. It runs on the real GPU when a
CUDA driver and a device answer, and on the simulated device otherwise, and
says which.

    python examples/batch_job.py [--inputs 64] [--deadline 0.1] [--device auto|sim|cuda:N] [-v | -vv]

On a terminal a progress bar runs on stderr (plain progress lines otherwise);
-v adds a line per input (its stream, how long each step took, the scope's
in-flight work and leases) and per cancellation, -vv every step. The first
Ctrl-C cancels the rest of the batch the way the deadline does. Exit status:
0 every check passed, 1 a check failed, 2 the job could not run (a bad option,
or the CUDA device asked for is not there), 130 interrupted; --help says more.

The job itself lives in ``trio_cuda._demo.batch``, its command line in
``trio_cuda._demo.cli`` (also ``python -m trio_cuda demo``).
"""

from __future__ import annotations

import sys

from trio_cuda._demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
