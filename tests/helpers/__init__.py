"""Code the tests share that is not a fixture: builders of datasets and runs, spawned ranks, readers of outputs.

Fixtures live in tests/conftest.py (all tests) or in a folder's conftest.py (that folder's tests); a test module
imports from here, never from another test module."""
