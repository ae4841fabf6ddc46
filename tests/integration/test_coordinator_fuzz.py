"""Property-based API fuzzing from the coordinator's OpenAPI schema (schemathesis): no 500s, and every
response matches the schema (status codes documented, bodies valid)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import schemathesis
from deltasync_coordinator.app import create_app
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.conftest import PUBLISHER_TOKEN, coordinator_settings

_tmp = Path(tempfile.mkdtemp(prefix="deltasync-fuzz-"))
APP = create_app(coordinator_settings(_tmp, max_wait_s=0.05))
AUTH = {"Authorization": f"Bearer {PUBLISHER_TOKEN}"}
schema = schemathesis.openapi.from_dict(APP.openapi())  # the served /openapi.json needs a token
schema.app = APP

pytestmark = pytest.mark.slow


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case: schemathesis.Case) -> None:
    # Cross-field rules (a delta's base below its version, manifest_key matching the version) cannot be
    # written in OpenAPI, so a "schema-valid" body may rightly get 422: that one heuristic is excluded.
    # With the publisher token: every route is reachable (the auth rules have their own tests).
    case.call_and_validate(headers=AUTH, excluded_checks=[positive_data_acceptance])
