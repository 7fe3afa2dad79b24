"""Fixtures for every test pytest collects: the suite in ``tests/`` and the doctests in
``orbax_flax/`` (``tests/conftest.py`` sets up the devices and the servers)."""

import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def _temporary_directories_in_the_basetemp(tmp_path_factory):
  """``tempfile.mkdtemp()`` in a test, a doctest or a doc's example (as users write it), and
  the test servers' data, go into one directory of pytest's basetemp, removed with it at
  the end of a session that passed: each run of the suite used to leave about 30 of them
  in /tmp. Session-wide, not per test: a server started during one test must outlive that
  test's tmp_path. Processes a test starts are not affected (``TMPDIR`` is unchanged)."""
  saved = tempfile.tempdir
  tempfile.tempdir = str(tmp_path_factory.mktemp("tempfile"))
  yield
  tempfile.tempdir = saved
