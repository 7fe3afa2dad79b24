"""Test setup: 8 simulated CPU devices, set before jax initialises.

On an accelerator (``JAX_PLATFORMS=tpu``) the tests that build their mesh from whatever
devices exist run there too (libtpu warns at start-up)::

  JAX_PLATFORMS=tpu pytest -W ignore::UserWarning tests/test_resume_trains.py \
    tests/test_async.py tests/test_nnx_resume.py \
    tests/test_engine.py::test_every_dtype_round_trips_bitwise \
    tests/test_engine.py::test_64_bit_dtypes_with_x64 \
    tests/test_engine.py::test_a_64_bit_device_target_with_x64_off_is_a_checked_conversion \
    tests/test_engine.py::test_a_64_bit_save_dtype_for_device_arrays_with_x64_off_is_refused \
    tests/test_engine.py::test_a_host_offloaded_target_restores_into_its_memory_kind \
    tests/test_engine.py::test_a_converting_restore_onto_another_layout_is_exact_under_any_budget \
    tests/test_engine.py::test_casts_numpy_calls_safe_but_that_round_are_refused \
    tests/test_engine.py::test_a_python_scalar_restores_into_any_dtype_that_holds_its_value \
    tests/test_differential.py -k "not multiprocess and not another_mesh"

(156 passed, 5 skipped on one TPU v5e chip, 2026-12-06, on bf67919;
benchmarks/README.md). The others expect the 8 CPU devices, or start processes of their own
on the CPU. On the lent chip's machine, which has jax: ``pip install --no-index --find-links
/opt/pypi/files flax optax orbax-checkpoint hypothesis safetensors psutil`` (``--no-index``
ignores an ``--index-url``), the wheels of ``.whl-tpu/`` with ``--no-deps --target
/tmp/ofx-site``, and ``PYTHONPATH=/tmp/ofx-site:$PWD:$PYTHONPATH`` (its own entry holds what
jax needs).
"""

import os
import shutil
import signal
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One JAX compilation cache for the processes the tests start (jobs.env_for): the
# example and worker jobs compile the same programs again and again, on 2 cores.
os.environ.setdefault("OFX_TEST_COMPILATION_CACHE", tempfile.mkdtemp(prefix="ofx-test-jax-cache-"))

# A shell starts a background job (``cmd &``) with SIGINT ignored, and the processes the tests
# start inherit that (exec keeps an ignored signal): the Ctrl-C tests' jobs then never see
# their Ctrl-C. Handled here, the processes start with SIGINT's default, as at a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

assert jax.device_count() == 8 or jax.devices()[0].platform != "cpu", jax.devices()

# Entry points the tests run as scripts: each defines absl's --config flag at import, so
# the doctest collection must not import two of them into one process.
collect_ignore = ["config_main.py", "dataclass_config_main.py"]


@pytest.fixture
def ckpt_dir(tmp_path):
  return str(tmp_path / "ckpt")


@pytest.fixture(scope="session")
def s3_server():
  """A SeaweedFS S3 server on loopback, shared by the session."""
  import s3server  # pylint: disable=g-import-not-at-top
  yield from s3server.S3Server.serve_new()


@pytest.fixture
def s3_bucket(s3_server):
  return s3_server.new_bucket()


def pytest_sessionfinish(session, exitstatus):  # pylint: disable=unused-argument
  # Under pytest-xdist (-n 2) the workers share the cache the controller made: the first
  # worker to finish removed it under the other's running jobs. Only the controller does.
  if "PYTEST_XDIST_WORKER" not in os.environ:
    shutil.rmtree(os.environ["OFX_TEST_COMPILATION_CACHE"], ignore_errors=True)
