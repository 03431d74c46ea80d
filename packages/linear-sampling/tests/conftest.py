import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Tiny problems: thread start-up dominates and the 2 shared cores are oversubscribed otherwise.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
