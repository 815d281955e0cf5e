import os

# Two cores in CI: more threads than cores only adds contention. Under pytest-xdist (`-n N`) the cores are
# shared by N workers, each computing in its own process: each gets its share, at least one thread.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if "PYTEST_XDIST_WORKER" in os.environ:
    # a worker inherits the controller's value: its own share instead (also for the processes its tests start)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
else:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

try:
    import torch

    torch.set_num_threads(_THREADS)
except ImportError:  # the torch-free synthesis test runs without it
    pass


# -- release fixtures shared by the release tests (keys, the tiny real denoiser, one valid release) ----------
# Module-scoped like the copies they replace: built once per test module, never shared between modules.
import shutil  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the slow tests first (each worker collects, in the same order). They are the
    longest and mostly wait on real processes: started first they overlap the other worker's computing, where
    started last one of them ran alone at the end for minutes. The sort is stable: a file's tests keep their
    order."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """Tiny models: with 2 threads on the shared, oversubscribed CI cores torch's sampler ran 70x slower.
    Use with ``pytestmark = pytest.mark.usefixtures("torch_one_thread")``."""
    import torch as _torch

    n = _torch.get_num_threads()
    _torch.set_num_threads(1)
    yield
    _torch.set_num_threads(n)


@pytest.fixture(scope="module")
def keys() -> Any:
    """Coordinator, site and site-administrator keys of site "a" (tests/support/release.Keys)."""
    from tests.support.release import new_keys

    return new_keys()


@pytest.fixture(scope="module")
def den() -> Any:
    """The project's real EDM UNet at a tiny size (torch)."""
    from tests.support.release import small_denoiser

    return small_denoiser()


@pytest.fixture(scope="module")
def den_onnx(den: Any) -> Any:
    """``den`` exported to ONNX."""
    from feta_release.release.onnx_export import export_denoiser
    from tests.support.release import IMAGE_SHAPE

    return export_denoiser(den, IMAGE_SHAPE)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, den_onnx: Any, keys: Any) -> Path:
    """One valid one-site release with its signed policy; tests copy it (``release``) before changing it."""
    from tests.support.release import make_release, signed_policy

    return make_release(
        tmp_path_factory.mktemp("rel") / "release", den_onnx, keys, policy=signed_policy(keys)
    )


@pytest.fixture
def release(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of ``pristine`` for one test."""
    dst = tmp_path / "release"
    shutil.copytree(pristine, dst)
    return dst


# -- real Flower processes on loopback (the slow end-to-end tests)
# ---------------------------------------------


class LoopbackFederation:
    """A SuperLink and one SuperNode per site of a test federation, as real processes on loopback (insecure).
    ``start`` returns the SuperLink's address; ``stop`` (also run at teardown) stops them all and returns
    their process group ids, so a test can check that nothing survived."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Any] = []

    def start(self, fed: Any, settle: float = 3.0) -> str:
        import time

        from coordinator.superlink import SuperLinkSettings, start_superlink
        from edge.launch import start_node
        from feta_release.federation.procs import free_port
        from tests.support.federation import node_settings

        port = free_port()
        self.procs.append(
            start_superlink(
                SuperLinkSettings(
                    port=port,
                    database=self.tmp / "coord" / "state.db",
                    insecure=True,
                    home=self.tmp / "coord",
                )
            )
        )
        for s in fed.sites:
            self.procs.append(
                start_node(
                    node_settings(
                        s,
                        superlink=f"127.0.0.1:{port}",
                        port=free_port(),
                        insecure=True,
                    )
                )
            )
        time.sleep(settle)  # let every node register before the job's first hello
        return f"127.0.0.1:{port}"

    def stop(self) -> list[int]:
        pgids = [p.pid for p in self.procs]
        for p in self.procs:
            p.stop()
        self.procs = []
        return pgids


@pytest.fixture
def loopback(tmp_path: Path) -> Iterator[LoopbackFederation]:
    """Real SuperLink + SuperNodes for a slow end-to-end test (stopped at teardown)."""
    lb = LoopbackFederation(tmp_path)
    try:
        yield lb
    finally:
        lb.stop()
