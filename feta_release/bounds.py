"""Numeric floors shared by the job config (checked when a job is read) and the mechanisms (checked again
where they clip). A module of its own so that reading a config does not import numpy and the mechanisms
package.

``MIN_CLIP``: the smallest clip bound accepted. Why a floor: clipped values are stored in float32, and
a clip in its subnormal range (e.g. 7e-45) makes each clipped entry round UP to the smallest subnormal, so one
record moved the sum by ~2x the clip the noise is scaled to. At >= 1e-6 rounding adds at most ~1e-45 per
entry: a relative excess below 1e-30 for any model size. No useful job clips below it (pixels and gradients
are O(1)).
"""

MIN_CLIP = 1e-6
