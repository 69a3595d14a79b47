"""The planner's stable argsort against NumPy's."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core.sorting import stable_argsort


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.one_of(st.integers(0, 5), st.integers(0, 2**40),
                               st.integers(-2**62, 2**63 - 1)), max_size=300),
       small=st.booleans())
def test_stable_argsort_is_numpys_stable_argsort(keys, small):
    """Ties keep index order (many ties when ``small``); keys that cannot share an int64 with
    the index (negative or huge) take the merge sort, with the same result."""
    key = np.array([k % 4 for k in keys] if small else keys, dtype=np.int64)
    got = stable_argsort(key)
    assert got.dtype == np.int64
    assert np.array_equal(got, np.argsort(key, kind="stable"))
