"""The API emulator keeps the apiserver semantics the operator and the stores rely on.

Real: HTTP over aiohttp to the emulator on a TCP port.  This tests the test double itself.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from typing import Any

import aiohttp
from tests.emulator import ApiEmulator

CM = "/api/v1/namespaces/default/configmaps"
JOBS = "/apis/refit.dev/v1alpha1/namespaces/default/refitjobs"
MERGE = {"Content-Type": "application/merge-patch+json"}


async def _call(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None, **kw: Any
) -> tuple[int, Any]:
    async with session.request(method, url, json=body, **kw) as response:
        return response.status, await response.json()


async def test_versions_uids_generation_and_conflicts(kube_emulator: ApiEmulator) -> None:
    base = kube_emulator.url
    async with aiohttp.ClientSession() as s:
        code, job = await _call(
            s, "POST", base + JOBS, {"metadata": {"name": "a"}, "spec": {"x": 1}}
        )
        assert code == 200 and job["metadata"]["uid"] and job["metadata"]["generation"] == 1
        rv0 = job["metadata"]["resourceVersion"]
        code, again = await _call(s, "POST", base + JOBS, {"metadata": {"name": "a"}})
        assert (code, again["reason"]) == (409, "AlreadyExists")
        url = f"{base}{JOBS}/a"
        code, job = await _call(s, "PATCH", url, {"spec": {"x": 2}}, headers=MERGE)
        assert job["metadata"]["generation"] == 2 and job["metadata"]["resourceVersion"] != rv0
        code, job = await _call(
            s, "PATCH", url + "/status", {"status": {"phase": "P"}}, headers=MERGE
        )
        assert job["metadata"]["generation"] == 2 and job["status"] == {"phase": "P"}
        # The main resource ignores status; the status subresource ignores the rest.
        code, job = await _call(s, "PATCH", url, {"status": {"phase": "X"}}, headers=MERGE)
        assert job["status"] == {"phase": "P"}
        stale = {"metadata": {"resourceVersion": rv0}, "status": {"phase": "Q"}}
        code, err = await _call(s, "PATCH", url + "/status", stale, headers=MERGE)
        assert (code, err["reason"]) == (409, "Conflict")
        code, job = await _call(s, "PUT", url, {**job, "spec": {"x": 3}})
        assert code == 200 and job["spec"] == {"x": 3} and job["metadata"]["generation"] == 3


async def test_label_selectors_and_merge_patch_null(kube_emulator: ApiEmulator) -> None:
    for name, labels in (("a", {"app": "x", "tier": "1"}), ("b", {"app": "y"}), ("c", {})):
        kube_emulator.create(
            "v1/configmaps", "default", {"metadata": {"name": name, "labels": labels}}
        )
    async with aiohttp.ClientSession() as s:
        for selector, names in (
            ("app=x", ["a"]),
            ("app", ["a", "b"]),
            ("!app", ["c"]),
            ("app!=x", ["b", "c"]),
            ("app in (x,y),tier", ["a"]),
            ("app notin (x)", ["b", "c"]),
        ):
            _, listing = await _call(
                s, "GET", kube_emulator.url + CM, params={"labelSelector": selector}
            )
            assert [i["metadata"]["name"] for i in listing["items"]] == names, selector
        url = f"{kube_emulator.url}{CM}/a"
        await _call(s, "PATCH", url, {"data": {"k1": "1", "k2": "2"}}, headers=MERGE)
        _, cm = await _call(s, "PATCH", url, {"data": {"k1": None}}, headers=MERGE)
        assert cm["data"] == {"k2": "2"}


async def test_cascading_delete_and_finalizers(kube_emulator: ApiEmulator) -> None:
    owner = kube_emulator.create(
        "refit.dev/v1alpha1/refitjobs", "default", {"metadata": {"name": "o", "finalizers": ["f"]}}
    )
    ref = {"uid": owner["metadata"]["uid"], "kind": "RefitJob", "name": "o", "controller": True}
    kube_emulator.create(
        "v1/pods", "default", {"metadata": {"name": "p", "ownerReferences": [ref]}}
    )
    kube_emulator.create("v1/configmaps", "default", {"metadata": {"name": "free"}})
    kube_emulator.delete("refit.dev/v1alpha1/refitjobs", "default", "o")
    held = kube_emulator.get("refit.dev/v1alpha1/refitjobs", "default", "o")
    assert held["metadata"]["deletionTimestamp"] and kube_emulator.find("v1/pods", "default", "p")
    kube_emulator.patch(
        "refit.dev/v1alpha1/refitjobs", "default", "o", {"metadata": {"finalizers": None}}
    )
    assert kube_emulator.find("refit.dev/v1alpha1/refitjobs", "default", "o") is None
    assert kube_emulator.find("v1/pods", "default", "p") is None
    assert kube_emulator.find("v1/configmaps", "default", "free") is not None


async def _read_events(response: aiohttp.ClientResponse, count: int) -> list[dict[str, Any]]:
    events = []
    while len(events) < count:
        line = await asyncio.wait_for(response.content.readline(), timeout=5)
        events.append(json.loads(line))
    return events


async def test_watch_resumes_from_a_version_and_expires(tmp_path: Any) -> None:
    async with ApiEmulator(tmp_path, history_limit=3) as api, aiohttp.ClientSession() as s:
        first = api.create("v1/configmaps", "default", {"metadata": {"name": "w"}})
        rv = first["metadata"]["resourceVersion"]
        api.patch("v1/configmaps", "default", "w", {"data": {"a": "1"}})
        params = {"watch": "true", "resourceVersion": rv}
        async with s.get(api.url + CM, params=params) as response:
            (event,) = await _read_events(response, 1)
            assert (event["type"], event["object"]["data"]) == ("MODIFIED", {"a": "1"})
            api.delete("v1/configmaps", "default", "w")
            (event,) = await _read_events(response, 1)
            assert event["type"] == "DELETED"
        for i in range(4):
            api.create("v1/configmaps", "default", {"metadata": {"name": f"x{i}"}})
        async with s.get(api.url + CM, params=params) as response:
            (event,) = await _read_events(response, 1)
            assert event["type"] == "ERROR"
            assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")


async def test_answers_while_the_test_loop_is_blocked(kube_emulator: ApiEmulator) -> None:
    # Worker processes PATCH the emulator while the test's loop runs kopf; an operator that
    # stops (or anything blocking that loop) must not stall their answers.
    kube_emulator.create("v1/configmaps", "default", {"metadata": {"name": "w"}, "data": {}})
    answers: list[int] = []

    def worker() -> None:
        request = urllib.request.Request(
            f"{kube_emulator.url}{CM}/w",
            data=json.dumps({"data": {"k": "v"}}).encode(),
            headers=MERGE,
            method="PATCH",
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            answers.append(response.status)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)  # blocks this loop on purpose for as long as the request takes
    assert answers == [200]
    assert kube_emulator.get("v1/configmaps", "default", "w")["data"] == {"k": "v"}
