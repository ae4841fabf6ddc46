"""docs/PROTOCOL.md and the OpenAPI schema list the same routes, and its settings table matches Settings."""

from __future__ import annotations

import re
from pathlib import Path

from deltasync_coordinator.app import create_app
from deltasync_coordinator.settings import Settings

DOC = (Path(__file__).parents[2] / "docs" / "PROTOCOL.md").read_text()


def test_every_documented_route_exists_and_every_route_is_documented(tmp_path: Path) -> None:
    documented = {(m, p) for m, p in re.findall(r"^\| `(GET|POST|PUT|DELETE)` \| `([^`]+)` \|", DOC, re.M)}
    app = create_app(Settings(db=tmp_path / "c.db", insecure=True))
    spec = app.openapi()
    app.state.db.close()
    served = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert documented == served


def test_every_setting_is_documented() -> None:
    for name in Settings.model_fields:
        assert f"DELTASYNC_{name.upper()}" in DOC, name
