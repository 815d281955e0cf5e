"""The noise mechanisms: central images, frequency statistics, Skellam, cells, feature maps, audits."""
