"""The backends: the simulator (sim_*), the CUDA backend on a real GPU (cuda_*), driver conformance,
backend choice, several devices.
"""
