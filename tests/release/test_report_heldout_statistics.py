"""The release report's utility figures are un-noised statistics of real held-out data: the page says so in a
labelled block and never shows the held-out set's size, class counts, per-class accuracies or plain hash, and
``evaluate`` writes a shareable evaluation.json without them (a salted commitment in place of the hash)."""

from __future__ import annotations

import os

from feta_release.evaluation import EvaluationReport, heldout_commitment
from feta_release.release.report import NOT_DP_HEADING, _utility

HELD_OUT_FINGERPRINT = "9f" * 32

OLD_FORMAT = {  # an evaluation.json as evaluate wrote it before: every held-out statistic in the clear
    "accuracy": 0.8731,
    "fd": 41.5,
    "fd_name": "FD (classifier features)",
    "chance_accuracy": 0.5,
    "per_class_accuracy": {"normal": 0.9137, "pneumonia": 0.8326},
    "n_synthetic": 600,
    "n_real": 4321,
    "n_fd": 4319,
    "class_names": ["normal", "pneumonia"],
    "real_class_counts": {"normal": 2171, "pneumonia": 2150},
    "real_source": "/data/st-mary/heldout",
    "real_fingerprint": HELD_OUT_FINGERPRINT,
    "classifier_epochs": 5,
    "feature_net_epochs": 3,
    "synthetic_fingerprint": "ab" * 32,
}


def test_the_report_labels_held_out_figures_not_dp_and_drops_their_size_counts_and_hash() -> None:
    html = _utility(OLD_FORMAT)
    assert NOT_DP_HEADING in html and "NOT covered by the release" in html
    assert "0.8731" in html and "41.5" in html  # the accuracy and FD stay, labelled
    for secret in ("4321", "4319", "2171", "2150", "0.9137", "0.8326", "st-mary", HELD_OUT_FINGERPRINT):
        assert secret not in html, secret


def test_the_shareable_evaluation_holds_a_salted_commitment_not_the_held_out_statistics() -> None:
    report = EvaluationReport(
        **{k: v for k, v in OLD_FORMAT.items() if k != "real_class_counts"},
        real_class_counts=OLD_FORMAT["real_class_counts"],
    )
    salt = os.urandom(32)
    doc = report.shareable(salt)
    for key in (
        "n_real",
        "n_fd",
        "real_class_counts",
        "per_class_accuracy",
        "real_fingerprint",
        "real_source",
    ):
        assert key not in doc, key
    assert HELD_OUT_FINGERPRINT not in str(doc) and "4321" not in str(doc)
    assert doc["real_commitment"] == heldout_commitment(HELD_OUT_FINGERPRINT, salt)
    assert doc["real_commitment"] != report.shareable(os.urandom(32))["real_commitment"]  # salted
    assert "not differentially private" in doc["not_dp"]
    html = _utility(doc)
    assert doc["real_commitment"] in html and NOT_DP_HEADING in html
