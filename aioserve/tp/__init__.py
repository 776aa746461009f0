"""Tensor parallelism's transport: one model over several processes (ranks),
rank 0 planning for all of them.

  distributed.py  the TP group and its collectives (identity at one rank): what the layers call
  codec.py        a BatchPlan as bytes and back, for the broadcast
  channel.py      rank 0 -> followers: each step's plan over a host broadcast; idle pings they answer
  lifeline.py     each rank notices when another one dies

It sits low (the layers, the models and the engine call it) and imports
nothing above it. The ranks' processes (rendezvous, rank 0's side, a
follower's loop) build engines, so they live at the top, in launch/; what
every rank holds reads the engine, so it is engine/tp_layout.py.
"""
