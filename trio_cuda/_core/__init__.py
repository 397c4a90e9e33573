"""The CUDA-free core: ops, futures, scopes, leases, owners, scheduling, errors.

Invariant: nothing in this package imports ``cuda``; a test imports it with
``cuda`` blocked. Backends plug in through :mod:`trio_cuda._core._driver`.
"""
