"""Tile kernels (cuTile): access analysis, compiling, the NumPy emulation, launches on the simulator,
tooling and examples.
"""
