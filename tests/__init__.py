"""The test suite, one subpackage per layer of the library (see tests/README.md)."""
