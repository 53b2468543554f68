"""Fixtures shared by the NumPy kernel tests (tests/backends/numpy/test_<family>.py)."""
import pytest
import torch

from fuelgraph.backends.numpy import common, norm


@pytest.fixture(scope="module", autouse=True)
def _torch_single_thread():
    """torch's OpenMP pool costs ~30 ms per tiny op on a loaded 2-core box; one thread is exact
    and fast here."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["default", "tiny"])
def chunking(request, monkeypatch):
    """'tiny' forces many chunks and the thread pool even for small arrays ('default' takes
    the norms' small-input path for the small cases)."""
    if request.param == "tiny":
        monkeypatch.setattr(common, "CHUNK_ELEMS", 96)
        monkeypatch.setattr(common, "PARALLEL_MIN_ELEMS", 0)
        monkeypatch.setattr(norm, "SMALL_ELEMS", 0)
    return request.param
