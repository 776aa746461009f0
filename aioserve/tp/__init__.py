"""Tensor parallelism: one model over several processes (ranks), rank 0
planning for all of them.

  distributed.py  the TP group and its collectives (identity at one rank): what the layers call
  codec.py        a BatchPlan as bytes and back, for the broadcast
  channel.py      rank 0 -> followers: each step's plan over a host broadcast
  lifeline.py     each rank notices when another one dies
  layout.py       what every rank holds (gathered once, logged, shown in /server_info)
  world.py        rendezvous: addresses, ports, node ranks, which ranks this node starts
  leader.py       rank 0's side: starts this node's followers, broadcasts every plan
  follower.py     a follower rank's loop: receive a plan, run it on its engine, repeat

The first four sit low (the layers and the engine use them); world, leader
and follower start processes and are wired from the top (launch.py,
runtime.py), above the scheduler, which knows only an executor.
"""
