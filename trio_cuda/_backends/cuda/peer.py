"""Copies between CUDA devices of one process (``CudaContext.copy_peer``).

Invariants:

* A copy between memory of two devices is one ``cuMemcpyPeerAsync`` on the
  stream of the context that enqueues it, made current first. Between devices
  that can access each other (``cuDeviceCanAccessPeer``), peer access is
  enabled once per ordered pair for the life of the process (both primary
  contexts are kept retained by the backend, so it never has to be undone):
  and the other device is granted access to its default memory pool
  (``cuMemPoolSetAccess``: stream-ordered allocations need their own grant);
  the copy then goes over the peer link (NVLink or PCIe). Without peer
  access the driver stages the same call through pinned host memory; the
  result and the stream ordering are the same, only slower.
* Memory of one device (two scopes on one device share its primary context)
  is copied with ``cuMemcpyDtoDAsync``.
* Nothing here blocks the host or waits for the device.
* The device, CUcontext and memory pool of a context come from its
  :attr:`CudaContext.state <.context.CudaContext.state>` (the
  :class:`~.state.ContextState` its components share).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _common
from .bindings import cu
from .context import CudaContext
from .errors import cuda_error
from .primary import ctx_lock

if TYPE_CHECKING:
    from .streams import CudaStream

#: (accessing ordinal, peer ordinal) -> whether peer access is enabled
_peer: dict[tuple[int, int], bool] = {}
_ALREADY_ENABLED = 704  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED


def peer_access(a: CudaContext, b: CudaContext) -> bool:
    """Enable, once, peer access between the devices of ``a`` and ``b`` (both
    ways) where the hardware allows it; True if copies between them go
    directly."""
    key = (a.ordinal, b.ordinal)
    known = _peer.get(key)
    if known is not None:
        return known
    ok = True
    with ctx_lock:
        for x, y in ((a.state, b.state), (b.state, a.state)):
            err, can = cu.cuDeviceCanAccessPeer(x.dev, y.dev)
            if err or not can:
                ok = False
                continue
            (err,) = cu.cuCtxSetCurrent(x.ctx)
            if err:
                raise cuda_error(err, "cuCtxSetCurrent")
            (err,) = cu.cuCtxEnablePeerAccess(y.ctx, 0)
            if err and int(err) != _ALREADY_ENABLED:
                ok = False
                continue
            # stream-ordered allocations (the default memory pool) need their
            # own grant: let y's device read and write x's pool memory
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = y.ordinal
            desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            (err,) = cu.cuMemPoolSetAccess(x.pool, [desc], 1)
            if err:
                ok = False
        _peer[(a.ordinal, b.ordinal)] = ok
        _peer[(b.ordinal, a.ordinal)] = ok
    return ok


def copy_peer(
    ctx: CudaContext,
    s: CudaStream,
    dst: int,
    dst_context: object,
    src: int,
    src_context: object,
    nbytes: int,
) -> None:
    """Enqueue on ``s`` (a stream of ``ctx``) a copy of ``nbytes`` from
    ``src`` (memory of ``src_context``) to ``dst`` (memory of ``dst_context``)."""
    _common.check_peer_contexts(dst_context, src_context, CudaContext)
    assert isinstance(dst_context, CudaContext)
    assert isinstance(src_context, CudaContext)
    nbytes = _common.check_count("nbytes", nbytes)
    if nbytes == 0:
        return None
    state = ctx.state
    if src_context.ordinal == dst_context.ordinal:
        state.make_current_if_needed()
        (err,) = cu.cuMemcpyDtoDAsync(dst, src, nbytes, s.cu)
        if err:
            state.fail(err, "cuMemcpyDtoDAsync")
        return None
    peer_access(src_context, dst_context)
    (err,) = cu.cuCtxSetCurrent(state.ctx)
    if err:
        raise cuda_error(err, "cuCtxSetCurrent")
    (err,) = cu.cuMemcpyPeerAsync(dst, dst_context.state.ctx, src, src_context.state.ctx, nbytes, s.cu)
    if err:
        state.fail(err, "cuMemcpyPeerAsync")
    return None
