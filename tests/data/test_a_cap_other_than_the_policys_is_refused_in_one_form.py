"""A patient cap other than the signed policy's is refused in ONE form wherever it is asked for (a flag
checked before any image is read, or the loader's cap when the policy's data are opened): "dataset.patient_cap
= S but WHERE asks for a patient cap of K; set it to S or remove it". The two checks worded it apart ("asks
for another cap", "is loaded with a patient cap of K"), so a reader could not tell they were one rule."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from feta_release.data.loading import check_cap_for_policy, policy_data
from feta_release.errors import ConfigError


@given(signed=st.integers(1, 9), asked=st.integers(1, 9))
def test_both_checks_refuse_another_cap_alike(signed: int, asked: int) -> None:
    policy = SimpleNamespace(privacy_unit="patient", patient_cap=signed, patients=10)
    report = SimpleNamespace(patients=np.zeros(3, np.int64), patient_cap=asked)
    if asked == signed:
        check_cap_for_policy(policy, asked, cap_source="--patient-cap", policy_source="p.json")
        return
    want = rf"^p.json: dataset.patient_cap = {signed} but .+ asks for a patient cap of {asked}; "
    want += rf"set it to {signed} or remove it$"
    with pytest.raises(ConfigError, match=want):
        check_cap_for_policy(policy, asked, cap_source="--patient-cap", policy_source="p.json")
    with pytest.raises(ConfigError, match=want):
        policy_data(policy, None, report, data_source="d.csv", policy_source="p.json")
