"""Suite-wide ordering: files with end-to-end runs of verl's trainer first.

``scripts/test.sh`` runs files on two pytest-xdist workers (``--dist loadfile``), handed out in collection order.
The end-to-end files take minutes each and the rest seconds, so starting them first keeps both workers busy with them
while the short files fill the gaps, instead of one worker finishing a long file alone at the end. Within each group
the order stays pytest's.
"""

from __future__ import annotations


def pytest_collection_modifyitems(session, config, items) -> None:
    heavy = {item.path for item in items if item.get_closest_marker("e2e") is not None}
    items.sort(key=lambda item: item.path not in heavy)
