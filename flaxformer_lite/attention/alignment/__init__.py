"""The alignment family: attention of the RNN sequence-to-sequence papers
(Bahdanau's additive score, Luong's dot/general/concat and local windows,
location-sensitive and hard attention) and CoPE's contextual positions.

Their scores are not a change to q.k (an MLP of q and k, a window chosen
from the query, counts of gates), so they are dense functions of their own
kind, outside the scheme protocol, behind the same registry and config
value. Importing this package registers them.
"""
from flaxformer_lite.attention.alignment import additive
from flaxformer_lite.attention.alignment import cope
from flaxformer_lite.attention.alignment import hard
from flaxformer_lite.attention.alignment import location
from flaxformer_lite.attention.alignment import luong
