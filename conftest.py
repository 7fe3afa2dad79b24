"""Fixtures for every test pytest collects: the suite in ``tests/`` and the doctests in
``orbax_flax/`` (``tests/conftest.py`` sets up the devices and the servers)."""

import tempfile

import pytest


@pytest.fixture(autouse=True)
def _temporary_directories_in_tmp_path(tmp_path, monkeypatch):
  """``tempfile.mkdtemp()`` in a test, a doctest or a doc's example (as users write it) makes
  its directory inside the test's ``tmp_path``, which is removed when the test passes: each
  run of the suite used to leave about 30 of them in /tmp. Processes a test starts are not
  affected (``TMPDIR`` is unchanged)."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
