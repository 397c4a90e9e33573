"""The CUDA-free core: ops, the launch layer and its packing, arrays, leases and byte ranges, policies,
futures, checkpoints, threads, Trio internals.
"""
