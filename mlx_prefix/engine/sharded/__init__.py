"""A model split over mlx.distributed ranks (mlx.launch): the process group and its
collectives (group.py), the model loaded sharded (load.py), every rank's engine taking
its turns in lockstep (lockstep.py, a turn driver) under rank 0's plan for each turn
(plan.py), how the group ends when a rank is lost (failure.py, watch.py), and
DistributedEngine (distributed.py), which builds a rank's Engine with those turns.
Import each name from its module.
"""
