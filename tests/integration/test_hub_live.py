"""Against the live Hugging Face Hub: runs only with HF_TOKEN and network access (skipped otherwise)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from deltasync import list_versions, read_weights
from deltasync.publisher import Publisher
from deltasync.store.hub import HubBucketStore
from deltasync.testing.stream import UpdateStream
from tests.conftest import assert_bit_equal

pytestmark = pytest.mark.hub


def _hub_reachable() -> str | None:
    if not os.environ.get("HF_TOKEN"):
        return "HF_TOKEN is not set"
    import httpx

    try:
        httpx.get(
            "https://huggingface.co/api/whoami-v2",
            timeout=5,
            headers={"Authorization": f"Bearer {os.environ['HF_TOKEN']}"},
        ).raise_for_status()
    except httpx.HTTPError as exc:
        return f"the Hub is not reachable ({exc.__class__.__name__})"
    return None


def test_publish_three_versions_and_pull_them_back(tmp_path: Path, update_stream: UpdateStream) -> None:
    reason = _hub_reachable()
    if reason:
        pytest.skip(reason)
    from huggingface_hub import HfApi

    api = HfApi()
    bucket = f"{api.whoami()['name']}/deltasync-test-{uuid.uuid4().hex[:8]}"
    try:
        writer = HubBucketStore(bucket, "run", cache_dir=tmp_path / "w")
        truth = {}
        with Publisher(writer) as pub:
            for step in range(3):
                weights = update_stream.bf16() if step == 0 else update_stream.step()
                truth[pub.publish(weights, step)] = weights
        assert api.bucket_info(bucket).private
        reader = HubBucketStore(bucket, "run", cache_dir=tmp_path / "r")  # a fresh store object and cache
        assert [x.version for x in list_versions(reader)] == [0, 1, 2]
        for version, weights in truth.items():
            assert_bit_equal(read_weights(reader, version), weights)
    finally:
        api.delete_bucket(bucket, missing_ok=True)
