"""Two tiers. Tests that start processes (a gloo world, or the meshkd command) are marked `world` and run
after the single-process ones, which alone take seconds: `python -m pytest -m "not world"`."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("world") is not None)  # stable: file order kept
