"""The lifetime contract: its rules, cancellation, conflicts, and the stateful, interleaving,
adversarial and attack tests.
"""
