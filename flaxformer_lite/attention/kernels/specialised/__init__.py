"""Hand-written forms of one scheme's attention, faster than the general
kernels for it: Shaw's by lag (relative_banded.py) and the causal band
(causal_band.py). Each is pinned to the dense reference by a test over
random inputs.
"""
