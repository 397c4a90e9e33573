"""Shared test helpers: kernels, run-under-a-limit guards, the adversarial program generator, Ctrl-C
and sanitizer helpers.
"""
