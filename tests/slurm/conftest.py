"""The local two-node Slurm cluster, started once per session for the tests that submit jobs
to it. `.ci/run` installs Slurm before the suite; where it is missing these tests skip with the
reason (a developer may set FASTPATH_SLURM_INSTALL=1 to let the fixture install it)."""

import time

import pytest

from tests.slurm.slurm_cluster import LocalSlurmCluster, SlurmUnavailable, ensure_installed


@pytest.fixture(scope="session")
def local_slurm():
    """Install (if missing) and start a loopback 2-node cluster once per session; stop it after."""
    try:
        install = ensure_installed()
    except SlurmUnavailable as e:
        pytest.skip(f"no local Slurm: {e}")
    cluster = LocalSlurmCluster.create()
    t0 = time.perf_counter()
    try:
        cluster.start()
    except SlurmUnavailable as e:
        cluster.stop(remove=True)
        pytest.skip(f"local Slurm did not start: {e}")
    print(f"\nlocal Slurm: apt install {install.seconds:.1f} s "
          f"({'installed now' if install.installed_now else 'already installed'}), "
          f"cluster start {time.perf_counter() - t0:.1f} s, root {cluster.root}")
    yield cluster
    cluster.stop(remove=True)
