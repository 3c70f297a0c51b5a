"""Keys' policies, usage and the priority gate (serving.security.load_keys, serving.usage):
key entries with settings, and their errors naming the entry; usage per key and day; quotas
that say which one and when it resets; the gate's order (class, then arrival, with ageing)."""

from __future__ import annotations

import asyncio
import time

import pytest

from serving.security import KeyPolicy, hash_key, key_id, load_keys
from serving.usage import PriorityGate, UsageStore, next_reset, quota_error, today


def test_key_entries_carry_policies(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text(f"# keys\nkey-plain-0001\nkey-high-00001 priority=10\n"
                 f"sha256:{hash_key('key-quota-0001')} images_per_day=5 "
                 f"device_seconds_per_day=2.5\n")
    keys = load_keys(str(f))
    assert keys == {hash_key("key-plain-0001"): KeyPolicy(),
                    hash_key("key-high-00001"): KeyPolicy(priority=10),
                    hash_key("key-quota-0001"): KeyPolicy(images_per_day=5,
                                                          device_seconds_per_day=2.5)}
    assert load_keys(["key-low-00001 priority=-1"]) == {hash_key("key-low-00001"):
                                                       KeyPolicy(priority=-1)}


@pytest.mark.parametrize("entry, words", [
    ("key-quota-0001 images_per_day=lots", "images_per_day='lots' is not a number"),
    ("key-quota-0001 images_per_day=-3", "images_per_day must be >= 0"),
    ("key-quota-0001 speed=9", "'speed=9' is not a key setting"),
    ("key-quota-0001 priority", "'priority' is not a key setting"),
])
def test_bad_key_settings_fail_naming_the_key(entry, words):
    with pytest.raises(ValueError) as e:
        load_keys([entry])
    assert words in str(e.value) and key_id(hash_key("key-quota-0001")) in str(e.value)


def test_usage_per_key_and_day(tmp_path):
    store = UsageStore(str(tmp_path / "db.sqlite"))
    day1 = time.time() - 86400
    store.add("app", "key_a", 1, 2, 8, 1.5, now=day1)
    store.add("app", "key_a", 1, 1, 4, 0.5)
    store.add("app", "key_a", 1, 3, 12, 1.0)
    store.add("app", None, 1, 1, 1, 0.1)
    store.add("other", "key_a", 1, 9, 9, 9.0)
    assert store.day("app", "key_a") == {"requests": 2, "images": 4, "steps": 16, "device_s": 1.5}
    assert store.day("app", "key_a", now=day1)["images"] == 2
    assert store.total("app", "key_a") == {"requests": 3, "images": 6, "steps": 24,
                                           "device_s": 3.0}
    assert store.day("app", None)["images"] == 1 and store.day("app", "key_b")["images"] == 0
    assert today(next_reset() + 1) != today()


def test_quotas_name_themselves_and_their_reset():
    policy = KeyPolicy(images_per_day=5, device_seconds_per_day=10)
    used = {"requests": 2, "images": 4, "steps": 8, "device_s": 3.0}
    assert quota_error(policy, used, 1, "key_x") is None
    err = quota_error(policy, used, 2, "key_x")
    assert err.status == 429 and err.code == "quota_exceeded"
    assert "images_per_day=5" in err.message and "key_x" in err.message
    assert "resets at" in err.message and 0 < int(err.headers["Retry-After"]) <= 86400
    err = quota_error(policy, dict(used, device_s=10.0), 1, "key_x")
    assert "device_seconds_per_day=10" in err.message


def test_the_gate_takes_classes_in_order_and_ages():
    async def main():
        gate = PriorityGate(1, age_s=1000)
        order = []

        waited = {}

        async def one(name, priority):
            waited[name] = await gate.acquire(priority)
            order.append(name)
            await asyncio.sleep(0.01)
            gate.release()

        assert await gate.acquire(0) == 0.0  # a free slot: no wait; now all are taken
        tasks = [asyncio.create_task(one(n, p)) for n, p in
                 (("low-1", 0), ("high", 5), ("low-2", 0), ("mid", 2), ("low-3", 0))]
        await asyncio.sleep(0.01)
        tasks[2].cancel()  # gives up while waiting: takes no slot
        await asyncio.sleep(0.01)
        gate.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert order == ["high", "mid", "low-1", "low-3"]
        assert gate.active == 0
        # each says how long it waited: high for the first release, the rest behind it in turn
        assert 0.015 <= waited["high"] < waited["mid"] < waited["low-1"] < waited["low-3"]
        # ageing: a class-0 request that waited 3 "age" units goes before a class-2 newcomer
        aged = PriorityGate(1, age_s=0.05)
        await aged.acquire(0)
        order.clear()
        old = asyncio.create_task(one("old", 0))
        await asyncio.sleep(0.15)
        new = asyncio.create_task(one("new", 2))
        await asyncio.sleep(0.01)
        aged.release()
        await asyncio.gather(old, new)
        assert order == ["old", "new"]

    asyncio.run(main())
