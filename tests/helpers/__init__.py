"""Modules the tests use, not tests themselves: probes and reference loops run inside a generated project
(as scripts, by path: tests/helpers/NAME.py), and fixtures' machinery (slurm_cluster) imported as
tests.helpers.NAME."""
