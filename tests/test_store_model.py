"""Model-based test: random sequences of store operations against a plain dict, for every store kind.

Hypothesis drives a state machine whose model is ``dict[str, bytes]`` plus the rules of
distcomm.store.rules (counters, compare_set); after every step the store and the model must agree
on the returned value and on the keys present. A missing key is probed with a zero timeout, which
must raise the timeout error at once.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from distcomm.errors import DistStoreTimeoutError
from distcomm.store import rules
from store_kinds import KINDS

keys = st.sampled_from(["a", "b", "c", "long/key/with/slashes", "", "\u00e9"])
values = st.binary(max_size=12) | st.sampled_from([b"0", b"7", b"-3", b"x"])
amounts = st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.integers(-5, 5)


def machine_for(kind: str):
    class StoreMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.opened = KINDS[kind]()
            self.store = self.opened.store
            self.store.set_timeout(timedelta(0))
            self.model: dict[str, bytes] = {}
            self.base = self.store.num_keys()

        def teardown(self):
            self.opened.close()

        @rule(key=keys, value=values)
        def set(self, key, value):
            self.store.set(key, value)
            self.model[key] = value

        @rule(key=keys)
        def get(self, key):
            if key in self.model:
                assert self.store.get(key) == self.model[key]
            else:
                with pytest.raises(DistStoreTimeoutError):
                    self.store.get(key)

        @rule(key=keys, amount=amounts)
        def add(self, key, amount):
            try:
                stored, total = rules.added(key, self.model.get(key), amount)
            except ValueError:
                with pytest.raises(ValueError):
                    self.store.add(key, amount)
                return
            assert self.store.add(key, amount) == total
            self.model[key] = stored

        @rule(key=keys, expected=values | st.just(b""), desired=values)
        def compare_set(self, key, expected, desired):
            new_value, returned = rules.compare_set_outcome(self.model.get(key), expected, desired)
            assert self.store.compare_set(key, expected, desired) == returned
            if new_value is not None:
                self.model[key] = new_value

        @rule(key=keys)
        def delete_key(self, key):
            existed = self.model.pop(key, None) is not None
            assert self.store.delete_key(key) is (True if kind.endswith("file") else existed)

        @rule(key=keys, value=values)
        def append(self, key, value):
            self.store.append(key, value)
            self.model[key] = self.model.get(key, b"") + value

        @rule(pairs=st.dictionaries(keys, values, max_size=3))
        def multi_set(self, pairs):
            self.store.multi_set(list(pairs), list(pairs.values()))
            self.model.update(pairs)

        @rule(some=st.lists(keys, max_size=3))
        def multi_get_or_wait(self, some):
            if all(k in self.model for k in some):
                assert self.store.multi_get(some) == [self.model[k] for k in some]
                self.store.wait(some)
            else:
                with pytest.raises(DistStoreTimeoutError):
                    self.store.multi_get(some)
                with pytest.raises(DistStoreTimeoutError):
                    self.store.wait(some)

        @rule(some=st.lists(keys, max_size=3))
        def check(self, some):
            assert self.store.check(some) == all(k in self.model for k in some)

        @invariant()
        def same_keys(self):
            assert sorted(self.store.list_keys()) == sorted(self.model)
            assert self.store.num_keys() == self.base + len(self.model)

    StoreMachine.__name__ = f"StoreMachine[{kind}]"
    return StoreMachine


# the fast tier keeps one store of each implementation; the prefixed ones and the other TCP clients are slow
FAST_KINDS = {"hash", "file", "tcp-client"}


@pytest.mark.parametrize("kind", [k if k in FAST_KINDS else pytest.param(k, marks=pytest.mark.slow)
                                  for k in sorted(KINDS)])
def test_store_behaves_like_a_dict(kind):
    machine = machine_for(kind)
    machine.TestCase.settings = settings(max_examples=12, stateful_step_count=25, deadline=None)
    machine.TestCase().runTest()
