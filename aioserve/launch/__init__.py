"""Starting a process in its role: the engine, its executor and the
scheduler wired from one config, and tensor parallelism's processes.

  wiring.py    engine, executor and scheduler from one config (rank 0 under TP)
  world.py     rendezvous: addresses, ports, node ranks, which ranks this node starts
  leader.py    rank 0's side: starts this node's followers, broadcasts every plan
  follower.py  a follower rank's loop: receive a plan, run it on its engine, repeat

It sits above the scheduler, which knows only an executor, and is wired
from the top (llm.py, runtime.py). Its __init__ imports nothing, so a
follower started as `python -m aioserve.launch.follower` loads no scheduler.
"""
