import pytest


@pytest.fixture(scope="session", autouse=True)
def _notebooks_meanwhile(request):
    """When this session runs the notebook tests too (last), their one-core kernels start now:
    the unit tests keep one core busy, the kernels take the other (tests/notebook_runs.py)."""
    if any(item.path.parent.name == "notebooks" and "executed" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("notebooks_running")
